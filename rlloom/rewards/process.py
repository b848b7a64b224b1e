"""`WorkerProcess`: the trainer's handle on one reward worker process (see `rlloom.rewards.worker`).

A worker is a fresh Python interpreter (`subprocess`, not a fork of the trainer, which holds threads
and torch state) started in a new session, as a subreaper of every process it starts
(`rlloom.rewards.process_tree`): `kill()` SIGKILLs the worker and everything below it, a daemon that
left its session included, before the worker is reaped, so no id can have been reused by then. A
worker also watches its parent: when the trainer dies without closing the pool (kill -9), the
worker kills its own tree within about half a second.

A worker's stdout and stderr (a reward function's prints) are a pipe of its own that a thread of
the trainer copies to the trainer's stderr: nothing a reward starts ever holds the trainer's stdout,
so `rlloom train ... | cat` ends with the run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from pathlib import Path
from typing import IO

import rlloom
from rlloom.rewards.calling import RewardInput
from rlloom.rewards.process_tree import kill_tree

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
    def start(cls, pickled_fn: bytes, *, memory_limit_bytes: int) -> WorkerProcess:
        """Start a worker that loads the reward function `pickled_fn`; it answers "ready" when it can score."""
        parent_conn, child_conn = Pipe()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_RLLOOM_ROOT, env.get("PYTHONPATH", "")) if p)
        args = [str(child_conn.fileno()), str(memory_limit_bytes), str(os.getpid())]
        popen = subprocess.Popen(
            [sys.executable, "-c", _ENTRY, *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            pass_fds=(child_conn.fileno(),),
            start_new_session=True,
            env=env,
        )
        child_conn.close()  # the child holds its own copy; closing ours makes its death an EOF here
        assert popen.stdout is not None
        threading.Thread(
            target=_forward, args=(popen.stdout,), name="reward-worker-output", daemon=True
        ).start()
        parent_conn.send((list(sys.path), pickled_fn))
        return cls(popen=popen, conn=parent_conn, started_at=time.monotonic())

    def send(self, chunk: list[tuple[int, RewardInput]], *, timeout_s: float) -> None:
        """Send samples `(task_id, RewardInput)` to score; raises OSError if the worker is gone."""
        self.conn.send(chunk)
        self.tasks.extend(task_id for task_id, *_ in chunk)
        self.deadline = time.monotonic() + timeout_s

    def kill(self) -> None:
        """SIGKILL the worker and every process it started (SIGKILL: a hung function may ignore
        SIGTERM), then reap it."""
        kill_tree(self.popen.pid)
        self.conn.close()
        try:
            self.popen.wait(timeout=5.0)
        except subprocess.TimeoutExpired:  # stuck in the kernel (e.g. on a dead NFS mount); leave it
            pass


def _forward(output: IO[bytes]) -> None:
    """Copy a worker's output to the trainer's stderr until no process holds its pipe (a full pipe
    would block the worker); if that stderr is gone, keep draining."""
    with output:
        while chunk := output.read1(65536):  # type: ignore[attr-defined]
            try:
                os.write(2, chunk)
            except OSError:
                pass
