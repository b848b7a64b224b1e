"""What runs inside a reward worker process, and the scoring of one sample shared with inline mode.

This module imports only the standard library (and torch must never be added here): every worker
process imports it, and a worker that imported torch would take seconds to start.

A worker is started by `rlloom.rewards.process.WorkerProcess` as
`python -c "from rlloom.rewards.worker import main; main()" FD MEMORY_LIMIT_BYTES PARENT_PID`, in a
session (process group) of its own, and talks over the socket FD:
1. it caps its address space at MEMORY_LIMIT_BYTES (0: no cap), receives `(sys_path, pickled_fn)`,
   and answers `("ready", None, None)`, or `("load_error", text, None)` and exits;
2. for each chunk `[(task_id, response_text, ground_truth), ...]` it receives, it sends one
   `(task_id, kind, payload)` per sample, in order, as soon as that sample is scored: kind `ok`
   (payload: the float score), `error` (the exception as text) or `invalid` (the repr of the bad
   return value). `None` asks it to exit.
"""

from __future__ import annotations

import math
import numbers
import os
import pickle
import resource
import signal
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Literal

Outcome = Literal["ok", "error", "invalid"]

FLOAT32_MAX = 3.4028234663852886e38
"""Largest finite float32: a score beyond it would turn into inf in the trainer's float32 tensors."""


def as_score(value: object) -> float | None:
    """A float within the float32 range from a real number (bool, int, float, numpy scalar), else None."""
    if not isinstance(value, numbers.Real):
        return None
    try:
        score = float(value)
    except (OverflowError, ValueError):  # an int too large for a float
        return None
    return score if math.isfinite(score) and abs(score) <= FLOAT32_MAX else None


def run_one(
    fn: Callable[[str, str], object], response_text: str, ground_truth: str
) -> tuple[Outcome, float | str]:
    """Call the reward function once; never raises (a `sys.exit` inside it is an error too)."""
    try:
        value = fn(response_text, ground_truth)
    except (Exception, SystemExit) as e:  # a reward function's bug must not stop the run; it is counted
        return "error", f"{type(e).__name__}: {e}"[:500]
    score = as_score(value)
    return ("ok", score) if score is not None else ("invalid", repr(value)[:200])


def main() -> None:
    """Entry point of a worker process (see the module docstring for its arguments)."""
    fd, memory_limit_bytes, parent_pid = (int(a) for a in sys.argv[1:4])
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when a worker stops
    os.set_inheritable(fd, False)  # programs a reward function runs must not hold the parent's socket
    conn = Connection(fd)
    if memory_limit_bytes > 0:
        resource.setrlimit(resource.RLIMIT_AS, (memory_limit_bytes, memory_limit_bytes))
    try:
        sys_path, pickled_fn = conn.recv()
        sys.path[:] = sys_path  # plug-in modules import exactly as they do in the trainer
        fn = pickle.loads(pickled_fn)
    except (Exception, SystemExit) as e:
        conn.send(("load_error", f"{type(e).__name__}: {e}"[:500], None))
        return
    conn.send(("ready", None, None))
    serve(conn, fn)


def serve(conn: Connection, fn: Callable[[str, str], object]) -> None:
    """Score chunks of samples until the parent sends None or goes away."""
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):  # the parent went away
            return
        if chunk is None:
            return
        for task_id, response_text, ground_truth in chunk:
            conn.send((task_id, *run_one(fn, response_text, ground_truth)))


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this process when the trainer dies (no orphaned workers after a kill -9)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the worker still exits when its socket closes
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(0)
