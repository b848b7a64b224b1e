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

from rlloom.observability.logger import Logger

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
    with tmp.open("w", encoding="utf-8") as f:
        f.writelines(kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(kept)


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
        if resume_from_step is None:
            mode = "w"
        else:
            truncate_metrics_jsonl(self.path, resume_from_step)
            mode = "a"
        self._file = self.path.open(mode, encoding="utf-8")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if "step" in metrics:
            raise ValueError(
                "metric key 'step' is reserved: the JSONL logger writes the step itself. "
                "Fix: name the metric component/quantity, e.g. 'trainer/optimizer_step'."
            )
        record = {"step": int(step)}
        record.update({key: _json_value(key, value) for key, value in metrics.items()})
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
