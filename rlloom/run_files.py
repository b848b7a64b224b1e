"""Writing the files of a run without following links, and failed writes as one line.

A run writes into a folder that someone else may have prepared: a symbolic link planted there
(`RUN_DIR/metrics.jsonl -> ~/.bashrc`, `RUN_DIR/hf -> ~/important`) would make the run overwrite,
truncate or delete what the link points to. So every file rlloom writes in a run folder (and in the
Hugging Face folders and checkpoints it builds) is opened here, with O_NOFOLLOW, and every folder it
writes into is checked with lstat; a link there is refused with a one-line `ConfigError` naming it.
The run folder itself may be a link: the user named it. Files inside a folder the run has just
created (`fresh_dir`: checkpoints and Hugging Face folders are built in one) cannot be links, so
writers that take a path (safetensors' `save_file`) write there directly.

Where a caller knows what a failed write (a full disk: ENOSPC, a quota: EDQUOT, a file-size limit:
EFBIG, or any other OSError) leaves intact, `write_failed` makes it `WriteFailed`: one line naming
the file, the space left on its disk and the fix (checkpoints say the same in their own error).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import IO

from rlloom.config import ConfigError, UserError

FIX_LINK = (
    "a planted link would make rlloom overwrite what it points to. Fix: remove the link (copy the real file "
    "or folder there if it belongs there), or write elsewhere (another trainer.run_dir or output folder)."
)


class WriteFailed(UserError):
    """A file of a run could not be written (full disk, quota, permissions): one line, exit 2."""


def refuse_link(path: str | os.PathLike) -> Path:
    """`path` unless it is a symbolic link (then a ConfigError naming it and its target)."""
    path = Path(path)
    if path.is_symlink():
        raise ConfigError(
            f"{str(path)!r} is a symbolic link (to {os.readlink(path)!r}); rlloom never writes through links "
            f"in the folders it writes: {FIX_LINK}"
        )
    return path


def make_dir(path: str | os.PathLike) -> Path:
    """Create the folder `path` (and missing parents) or take the existing one; a link is refused."""
    path = refuse_link(path)
    path.mkdir(parents=True, exist_ok=True)
    return refuse_link(path)  # also when it appeared between the check and mkdir


def fresh_dir(path: str | os.PathLike) -> Path:
    """An empty folder at `path`, created now (an older folder of that name is deleted first; a link
    there is refused, never followed or deleted)."""
    path = refuse_link(path)
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)  # fails if anything (a link planted since) is there
    return path


def open_fd(path: str | os.PathLike, flags: int, mode: int = 0o644) -> int:
    """`os.open` that never follows a link at `path` (O_NOFOLLOW): a link is a ConfigError, any other
    failure the OSError (a caller that knows what was kept turns it into `write_failed`)."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError:
        refuse_link(path)  # ELOOP: a link is there
        raise


def open_text(path: str | os.PathLike, *, append: bool = False) -> IO[str]:
    """Open `path` to write text (truncated, or appended to with `append`), never through a link."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
    return os.fdopen(open_fd(path, flags), "a" if append else "w", encoding="utf-8")


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` (replacing it), never through a link."""
    with open_text(path) as f:
        f.write(text)


def free_space(path: str | os.PathLike) -> str:
    """The space left on the disk that holds `path` (or its nearest existing parent), e.g. '1.5 GiB'."""
    folder = Path(path).absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return "unknown"
    return f"{free / 2**30:.1f} GiB" if free >= 2**28 else f"{free / 2**20:.1f} MiB"


def write_failed(path: str | os.PathLike, error: OSError, fix: str) -> WriteFailed:
    """The one-line error of a failed write of `path`; `fix` says what was kept and how to go on."""
    return WriteFailed(
        f"writing {str(path)!r} failed: {error.strerror or error} ({free_space(path)} free on its disk). Fix: {fix}"
    )
