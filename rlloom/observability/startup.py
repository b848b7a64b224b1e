"""Time from process start to the first generated token, the start-up phase that fast start
(compile caches on disk, `rlloom.compile_cache`) shortens.

The rollout engine calls `mark_first_token()` each time sampled tokens reach the host; the first call
of the process records the seconds since the process started (from the kernel's process start time,
so Python's and torch's imports count) and logs it as a start-up phase:

    [rlloom] ... INFO start-up: first generated token 41.3 s after process start

`first_token_s()` returns it (None before), and the trainer logs it once as `perf/first_token_s`.
With one step always in flight in the engine, the first tokens reach the host once the second
forward is launched, so the time includes the first decode step's compilation and CUDA-graph capture.
"""

from __future__ import annotations

import logging
import os
import time

logger = logging.getLogger(__name__)

_IMPORTED_AT = time.monotonic()  # fallback origin where the process start time is not readable
_first_token: list[float] = []


def seconds_since_process_start() -> float:
    """Seconds since this process started (Linux: /proc; elsewhere: since this module's import)."""
    try:
        with open("/proc/self/stat") as f:  # field 22, after the parenthesised command name
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
        return uptime_s - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED_AT


def mark_first_token() -> None:
    """Record (and log) the time to the first generated token; later calls do nothing."""
    if not _first_token:
        _first_token.append(seconds_since_process_start())
        logger.info("start-up: first generated token %.1f s after process start", _first_token[0])


def first_token_s() -> float | None:
    """Seconds from process start to the first generated token, or None if none was generated yet."""
    return _first_token[0] if _first_token else None
