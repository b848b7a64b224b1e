"""What runs inside an environment worker process (started like a reward worker, by
`rlloom.rewards.process.WorkerProcess` with this module's entry, in a process group of its own that
dies with the trainer).

Protocol over the socket: it receives `(sys_path, pickled EnvSpec)` and answers `("ready", None,
None)` (or `("load_error", text, None)`); then, for each task `(task_id, env_bytes, method, arg)`, it
rebuilds the environment and its state (`env_bytes`: the pickled pair; None: a new environment from
the spec and an empty state), calls the method through `spec.call` (an agent's spec runs the agent) (awaiting it when it is `async def`), checks what it
returned, and answers `[(task_id, "ok", (value, pickled (environment, state)))]` or
`[(task_id, "error", text)]`. `None` asks it to
exit. The environment is pickled between calls, so its attributes persist and any worker can run any
trajectory's next call: a killed worker costs only the call it was running.
"""

from __future__ import annotations

import os
import pickle
import resource
import signal
import sys
from multiprocessing.connection import Connection

from rlloom.rewards.process_tree import become_subreaper
from rlloom.rewards.worker import die_with_parent


def main() -> None:
    fd, memory_limit_bytes, parent_pid = (int(a) for a in sys.argv[1:4])
    become_subreaper()  # what an environment or a tool starts stays in this tree, and dies with it
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.set_inheritable(fd, False)
    conn = Connection(fd)
    try:
        if memory_limit_bytes > 0:
            resource.setrlimit(resource.RLIMIT_AS, (memory_limit_bytes, memory_limit_bytes))
        sys_path, pickled_spec = conn.recv()
        sys.path[:] = sys_path
        spec = pickle.loads(pickled_spec)
        spec.preload()  # plug-ins import now: their import time never counts against a call's deadline
    except (Exception, SystemExit) as e:
        conn.send(("load_error", f"{type(e).__name__}: {e}"[:500], None))
        return
    conn.send(("ready", None, None))
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        task_id, env_bytes, method, arg = task
        try:
            env, state = (spec.build(), {}) if env_bytes is None else pickle.loads(env_bytes)
            value = spec.call(env, state, method, arg)
            conn.send([(task_id, "ok", (value, pickle.dumps((env, state))))])
        except (Exception, SystemExit) as e:  # noqa: BLE001 - the trajectory fails, the worker goes on
            conn.send([(task_id, "error", f"{type(e).__name__}: {e}"[:1000])])
