"""One run per run directory: an exclusive lock on RUN_DIR/.lock, held for the whole run.

The lock is an `flock` on the file, so the kernel drops it when the holder dies (a kill -9 or a
crash leaves no stale lock: the next run takes it over and says whose it was). The file holds the
holder's pid and host, which a refused second run names. On NFS, Linux maps `flock` to a POSIX
byte-range lock, which NFSv4 servers enforce across hosts.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path
from types import TracebackType

from rlloom.config import ConfigError
from rlloom.run_files import open_fd, write_failed

LOCK_FILE = ".lock"
log = logging.getLogger(__name__)


def _holder(text: str) -> str:
    try:
        info = json.loads(text)
        return f"pid {info['pid']} on host {info['host']!r}"
    except (ValueError, KeyError, TypeError):
        return "a process that has not written its pid yet"


class RunDirLock:
    """`with RunDirLock(run_dir):` holds the run directory; a second holder gets a ConfigError."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            folder = self.path.parent
            why = "it is a file, not a folder" if folder.is_file() else e.strerror or str(e)
            raise ConfigError(
                f"trainer.run_dir={str(folder)!r} cannot be written: {why}. Fix: choose a "
                "folder you can write to (it is created if missing)."
            ) from e
        fd = open_fd(self.path, os.O_RDWR | os.O_CREAT)  # a link planted as .lock is refused
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(os.pread(fd, 4096, 0).decode(errors="replace"))
            os.close(fd)
            raise ConfigError(
                f"trainer.run_dir={str(self.path.parent)!r} is in use by another run ({holder}, lock file "
                f"{str(self.path)!r}); two runs in one folder would mix their checkpoints and metrics. Fix: wait "
                "for it to finish or stop it, or choose another trainer.run_dir."
            ) from None
        previous = os.pread(fd, 4096, 0).decode(errors="replace")
        if previous.strip():
            log.info("took over the lock of %s, which ended without releasing it", _holder(previous))
        record = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(record).encode(), 0)
        except OSError as e:  # a full disk: nothing of the run has started yet
            os.close(fd)
            raise write_failed(
                self.path, e, "free disk space there, or choose another trainer.run_dir."
            ) from e
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)  # an empty file: released cleanly
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> RunDirLock:
        self.acquire()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()
