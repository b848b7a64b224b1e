"""Metrics as JSON lines: one object `{"step": s, "<key>": value, ...}` per `log` call.

The file is flushed after every line, so a crash loses at most the line being written. On resume
from step s, lines with step >= s (logged after the checkpoint the run resumes from) are dropped
before appending, so the log of an interrupted-and-resumed run equals that of an uninterrupted one.
Non-finite values (NaN, inf) are written as `null` to keep every line strict JSON.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import IO

from rlloom.observability.logger import Logger
from rlloom.run_files import open_text, write_failed

FIX_LOG = "free disk space, then continue with trainer.resume=auto (the run's checkpoints are intact)."

log = logging.getLogger(__name__)


def _parse_lines(path: Path) -> list[tuple[str, dict]]:
    """(raw line, parsed object) for every well-formed line; a torn or corrupt line is skipped."""
    out = []
    with path.open("r", encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                # The last line may be torn by a crash mid-write; anything else is worth a warning too.
                log.warning("%s:%d is not valid JSON and is skipped", path, number)
                continue
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                log.warning("%s:%d has no integer 'step' and is skipped", path, number)
                continue
            out.append((line if line.endswith("\n") else line + "\n", record))
    return out


def read_metrics_jsonl(path: str | Path) -> list[dict]:
    """Every record of a metrics.jsonl file, in file order (`null` values come back as None)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"metrics file {path} does not exist. Fix: point at a run folder written with logging.jsonl=true."
        )
    return [record for _, record in _parse_lines(path)]


def truncate_metrics_jsonl(path: str | Path, from_step: int) -> int:
    """Drop every line with step >= `from_step` (and torn lines), in place; returns lines kept."""
    path = Path(path)
    if not path.is_file():
        return 0
    kept = [line for line, record in _parse_lines(path) if record["step"] < from_step]
    # Write a sibling then rename, so a crash here leaves either the old or the new file.
    tmp = path.with_name(path.name + ".tmp")
    with open_text(tmp) as f:
        f.writelines(kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(kept)


def append_line(file: IO[str], path: Path, text: str) -> None:
    """Write and flush `text` to the open log `file` at `path`; a failed write (a full disk) is one
    `WriteFailed` line naming the file."""
    try:
        file.write(text)
        file.flush()
    except OSError as e:
        raise write_failed(path, e, FIX_LOG) from e


def _json_value(key: str, value: object) -> float | int | bool | None:
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value
    try:
        number = float(value)  # type: ignore[arg-type]  # also takes 0-d tensors and numpy scalars
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"metric {key!r} has value {value!r} of type {type(value).__name__}: metrics are scalars. "
            "Fix: log a float (reduce tensors first)."
        ) from error
    return number if math.isfinite(number) else None


class JsonlLogger(Logger):
    """Appends one JSON object per `log` call to `path` (conventionally run_dir/metrics.jsonl)."""

    def __init__(self, path: str | Path, resume_from_step: int | None = None) -> None:
        """`resume_from_step=None` starts a fresh file; an int keeps the lines before that step."""
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_from_step is not None:
            truncate_metrics_jsonl(self.path, resume_from_step)
        self._file = open_text(self.path, append=resume_from_step is not None)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if "step" in metrics:
            raise ValueError(
                "metric key 'step' is reserved: the JSONL logger writes the step itself. "
                "Fix: name the metric component/quantity, e.g. 'trainer/optimizer_step'."
            )
        record = {"step": int(step)}
        record.update({key: _json_value(key, value) for key, value in metrics.items()})
        append_line(self._file, self.path, json.dumps(record) + "\n")

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
