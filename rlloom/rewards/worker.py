"""What runs inside a reward worker process, and the scoring of one sample shared with inline mode.

This module imports only the standard library (and torch must never be added here): every worker
process imports it, and a worker that imported torch would take seconds to start.

Protocol over the worker's pipe: the worker first sends `("ready", None, None)`; then for each
`(task_id, response_text, ground_truth)` it receives, it sends `(task_id, kind, payload)` with
kind `ok` (payload: the float score), `error` (payload: the exception as text) or `invalid`
(payload: the repr of the bad return value). `None` asks it to exit.
"""

from __future__ import annotations

import math
import numbers
import signal
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Literal

Outcome = Literal["ok", "error", "invalid"]


def as_score(value: object) -> float | None:
    """A finite float from a real number (bool, int, float, numpy scalar), else None."""
    if not isinstance(value, numbers.Real):
        return None
    score = float(value)
    return score if math.isfinite(score) else None


def run_one(
    fn: Callable[[str, str], object], response_text: str, ground_truth: str
) -> tuple[Outcome, float | str]:
    """Call the reward function once; never raises."""
    try:
        value = fn(response_text, ground_truth)
    except Exception as e:  # a reward function's bug must not stop the run; it is counted instead
        return "error", f"{type(e).__name__}: {e}"[:500]
    score = as_score(value)
    return ("ok", score) if score is not None else ("invalid", repr(value)[:200])


def worker_main(conn: Connection, fn: Callable[[str, str], object]) -> None:
    """The loop of one worker process."""
    # Ctrl-C goes to the whole process group; the parent decides what happens to workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn.send(("ready", None, None))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the parent went away
            return
        if message is None:
            return
        task_id, response_text, ground_truth = message
        kind, payload = run_one(fn, response_text, ground_truth)
        conn.send((task_id, kind, payload))
