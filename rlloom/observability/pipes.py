"""A run outlives its console: `with console_may_close():` around the steps keeps a closed stdout
or stderr from ending the run.

`rlloom train ... | tee run.log` and Ctrl-C: the terminal's SIGINT ends tee at once, and the next
line rlloom printed (the progress line, a sample, a log line, the stop's message) raised
BrokenPipeError wherever it was, so the run died (exit 141, no message) without the checkpoint of
the step under way. Inside the block, a stream whose reader is gone is pointed at /dev/null and the
run goes on without console output; its metrics, samples and checkpoints are in the run folder as
always. (Python ignores SIGPIPE itself, so a broken pipe is this exception, never the signal.)
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO


class DiscardOnBrokenPipe:
    """`stream`, whose writes go to /dev/null from the first broken pipe on (its file descriptor is
    pointed there, so the interpreter's flush at exit does not fail either)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._to_devnull()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._to_devnull()

    def _to_devnull(self) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self._stream.fileno())
        os.close(devnull)
        self._stream.flush()  # what the broken write left in the buffer goes to /dev/null

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ... of the stream
        return getattr(self._stream, name)


@contextmanager
def console_may_close() -> Iterator[None]:
    """`sys.stdout` and `sys.stderr` discard output once their reader is gone, until the block ends."""
    saved = sys.stdout, sys.stderr
    sys.stdout = DiscardOnBrokenPipe(sys.stdout)  # type: ignore[assignment]
    sys.stderr = DiscardOnBrokenPipe(sys.stderr)  # type: ignore[assignment]
    try:
        yield
    finally:
        sys.stdout.flush()  # through the guard: the interpreter's flush at exit finds nothing to fail on
        sys.stderr.flush()
        sys.stdout, sys.stderr = saved
