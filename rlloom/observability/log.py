"""Python logging for rlloom: `init_logger()` once at the entry point.

Modules log through `logging.getLogger(__name__)`; their loggers are children of `rlloom`, which
`init_logger` gives one handler printing `[rlloom] LEVEL message` to stderr.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

_ROOT = "rlloom"
_HANDLER_NAME = "rlloom-stderr"


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is at emit time, so a live console display that redirects
    stderr (rich's Live) can print log lines above its progress line instead of through it."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> TextIO:  # replaces StreamHandler's plain attribute
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass


def init_logger(level: int | str = logging.INFO) -> logging.Logger:
    """Configure the `rlloom` logger once (idempotent: later calls only change the level)."""
    logger = logging.getLogger(_ROOT)
    logger.setLevel(level)
    if not any(h.get_name() == _HANDLER_NAME for h in logger.handlers):
        handler = _StderrHandler()
        handler.set_name(_HANDLER_NAME)
        handler.setFormatter(logging.Formatter("[rlloom] %(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
        # The handler above prints; do not print again through a root handler someone else set up.
        logger.propagate = False
    return logger
