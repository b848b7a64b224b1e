"""`WorkerProcess`: the trainer's handle on one reward worker process (see `rlloom.rewards.worker`).

A worker is a fresh Python interpreter (`subprocess`, not a fork of the trainer, which holds threads
and torch state) started in a new session, so it leads a process group of its own: `kill()` sends
SIGKILL to the whole group, which also ends any program the reward function started. The group is
killed before the worker is reaped, so its id cannot have been reused by then. A worker also
watches its parent: when the trainer dies without closing the pool (kill -9), the worker kills
its own group within about half a second.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from pathlib import Path

import rlloom
from rlloom.rewards.calling import RewardInput

_RLLOOM_ROOT = str(Path(rlloom.__file__).resolve().parent.parent)
_ENTRY = "from rlloom.rewards.worker import main; main()"


@dataclass(slots=True)
class WorkerProcess:
    """One worker, its socket, and the samples sent to it that have no result yet (oldest first)."""

    popen: subprocess.Popen[bytes]
    conn: Connection
    started_at: float
    ready: bool = False
    tasks: deque[int] = field(default_factory=deque)
    """Ids of the samples sent and not yet answered; the first is the one being scored."""
    deadline: float = 0.0
    """When the first task times out: `timeout_s` after it was sent or after the previous result."""

    @classmethod
    def start(cls, pickled_fn: bytes, *, memory_limit_bytes: int, entry: str = _ENTRY) -> WorkerProcess:
        """Start a worker that loads `pickled_fn` (the reward function; for `entry` another worker's
        main, its payload); it answers "ready" when it can work."""
        parent_conn, child_conn = Pipe()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_RLLOOM_ROOT, env.get("PYTHONPATH", "")) if p)
        args = [str(child_conn.fileno()), str(memory_limit_bytes), str(os.getpid())]
        popen = subprocess.Popen(
            [sys.executable, "-c", entry, *args],
            stdin=subprocess.DEVNULL,
            pass_fds=(child_conn.fileno(),),
            start_new_session=True,
            env=env,
        )
        child_conn.close()  # the child holds its own copy; closing ours makes its death an EOF here
        parent_conn.send((list(sys.path), pickled_fn))
        return cls(popen=popen, conn=parent_conn, started_at=time.monotonic())

    def send(self, chunk: list[tuple[int, RewardInput]], *, timeout_s: float) -> None:
        """Send samples `(task_id, RewardInput)` to score; raises OSError if the worker is gone."""
        self.conn.send(chunk)
        self.tasks.extend(task_id for task_id, *_ in chunk)
        self.deadline = time.monotonic() + timeout_s

    def kill(self) -> None:
        """SIGKILL the worker's process group (the worker and every process it started), then reap it."""
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)  # SIGKILL: a hung function may ignore SIGTERM
        except ProcessLookupError:  # the group is empty: the worker and its children are gone
            pass
        self.conn.close()
        try:
            self.popen.wait(timeout=5.0)
        except subprocess.TimeoutExpired:  # stuck in the kernel (e.g. on a dead NFS mount); leave it
            pass

    def stop(self) -> None:
        """Ask the worker to exit, give it a moment, then kill its group either way."""
        try:
            self.conn.send(None)
            self.popen.wait(timeout=1.0)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            pass
        self.kill()
