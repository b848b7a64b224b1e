"""What runs inside a reward worker process.

This module imports only the standard library (and torch must never be added here): every worker
process imports it, and a worker that imported torch would take seconds to start.

A worker is started by `rlloom.rewards.process.WorkerProcess` as
`python -c "from rlloom.rewards.worker import main; main()" FD MEMORY_LIMIT_BYTES PARENT_PID`, in a
session (process group) of its own, as the subreaper of what it starts (`process_tree`), and talks
over the socket FD:
1. it caps its address space at MEMORY_LIMIT_BYTES (0: no cap), receives `(sys_path, pickled_fn)`,
   and answers `("ready", None, None)`, or `("load_error", text, None)` and exits;
2. for each chunk `[(task_id, RewardInput), ...]` it receives, it sends lists of results
   `(task_id, kind, payload)` in order: one list per sample as soon as that sample is scored, or,
   for a batched function (`rlloom.rewards.calling`), one list for the whole chunk. Kind `ok`
   (payload: the float score), `error` (the exception as text) or `invalid` (the repr of the bad
   return value). It ends when the trainer kills it (`WorkerProcess.kill`) or goes away.
"""

from __future__ import annotations

import os
import pickle
import resource
import signal
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

from rlloom.rewards.calling import is_batched, score_items
from rlloom.rewards.process_tree import become_subreaper, kill_tree

_PARENT_POLL_S = 0.5


def main() -> None:
    """Entry point of a worker process (see the module docstring for its arguments)."""
    fd, memory_limit_bytes, parent_pid = (int(a) for a in sys.argv[1:4])
    become_subreaper()  # before any code of the reward runs: no daemon it starts escapes the tree
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when a worker stops
    os.set_inheritable(fd, False)  # programs a reward function runs must not hold the parent's socket
    conn = Connection(fd)
    try:
        if memory_limit_bytes > 0:
            resource.setrlimit(resource.RLIMIT_AS, (memory_limit_bytes, memory_limit_bytes))
        sys_path, pickled_fn = conn.recv()
        sys.path[:] = sys_path  # plug-in modules import exactly as they do in the trainer
        fn = pickle.loads(pickled_fn)
    except (Exception, SystemExit) as e:
        conn.send(("load_error", f"{type(e).__name__}: {e}"[:500], None))
    else:
        conn.send(("ready", None, None))
        serve(conn, fn)
    kill_tree(os.getpid())  # a worker never just exits: its orphans would go to init and outlive the run


def serve(conn: Connection, fn: Callable[..., object]) -> None:
    """Score chunks of samples until the parent goes away."""
    batched = is_batched(fn)
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):  # the parent went away
            return
        if batched:  # one call for the chunk, one message with every result
            results = score_items(fn, [item for _, item in chunk])
            conn.send([(task_id, *result) for (task_id, _), result in zip(chunk, results)])
            continue
        for task_id, item in chunk:  # one message per sample, so that a hang is pinned on its sample
            conn.send([(task_id, *score_items(fn, [item])[0])])


def _die_with_parent(parent_pid: int) -> None:
    """End this worker and every process it started when the trainer dies (even by SIGKILL), so
    that no hung worker outlives it: a daemon thread notices that the parent process changed."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_PARENT_POLL_S)
        kill_tree(os.getpid())

    threading.Thread(target=watch, name="watch-trainer", daemon=True).start()
