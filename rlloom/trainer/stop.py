"""A run stops cleanly on Ctrl-C (SIGINT) or a scheduler's SIGTERM: the step under way finishes, a
checkpoint is written (in the asynchronous modes after dropping what is in flight and giving its
prompts back, as before a scheduled one: `AsyncLoop.drain`), and `RunStopped` says where to continue
from; a second signal stops at once.

Without this, Ctrl-C raised KeyboardInterrupt wherever the step was and everything since the last
`trainer.save_every` checkpoint was lost; a preempted job (SLURM, Kubernetes: SIGTERM, then SIGKILL
after a grace period) lost the same. Handlers are installed only around the step loop and only from
the main thread (Python runs signal handlers there alone); elsewhere the signals act as they would.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from types import FrameType

from rlloom.observability.log import init_logger

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class RunStopped(Exception):
    """The run stopped on a signal after `step`, with its checkpoint in `checkpoint`."""

    def __init__(self, signum: int, step: int, checkpoint: Path) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        super().__init__(
            f"stopped by {signal.Signals(signum).name} after step {step}; its checkpoint is {checkpoint}. "
            "Continue with the same command and trainer.resume=auto."
        )

    @property
    def exit_code(self) -> int:
        """128 + the signal's number, as a shell reports a process the signal ended."""
        return 128 + self.signum


class StopSignals:
    """`with StopSignals() as stop:` records the first SIGINT/SIGTERM in `stop.signum` (the loop
    checks it between steps); the second one stops at once: KeyboardInterrupt for SIGINT, the
    default action for SIGTERM. The previous handlers come back on exit."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._first)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _first(self, signum: int, frame: FrameType | None) -> None:
        self.signum = signum
        for s in SIGNALS:  # a second signal, of either kind, acts at once
            signal.signal(s, signal.default_int_handler if s == signal.SIGINT else signal.SIG_DFL)
        name = signal.Signals(signum).name
        init_logger().warning(
            "%s: stopping after the step under way and its checkpoint (%s again stops now, losing that step)",
            name,
            "Ctrl-C" if signum == signal.SIGINT else name,
        )
