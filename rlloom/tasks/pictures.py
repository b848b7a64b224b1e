"""The pictures of the built-in visual tasks: each drawn once with Pillow into a folder of the temp
directory and named by what it shows, so runs, processes and the train and eval splits share the
files, and a run needs no dataset on disk."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def task_folder(name: str) -> Path:
    """The folder of one task's pictures (`name` carries the drawing's version, e.g.
    `visual_compare-v1`), in the temp directory."""
    return Path(tempfile.gettempdir()) / "rlloom-tasks" / name


def saved_picture(path: Path, render: Callable[[], Any]) -> str:
    """`path`, drawn by `render()` (a PIL image) on first use: written under a temporary name then
    renamed, so concurrent runs never read half a file."""
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.parent / f".{path.name}.{os.getpid()}.tmp"
        render().save(partial, format="PNG")
        os.replace(partial, path)
    return str(path)
