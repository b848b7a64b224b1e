"""Prompt records and reading them from jsonl or parquet files.

A dataset row holds a prompt under `prompt_key` (a string, or a list of chat messages
`{"role": ..., "content": ...}`) and a ground truth under `answer_key`. Reading gives `RawPrompt`
records (text, not yet tokenized); `rlloom.data.chat.tokenize_prompts` turns them into the
`PromptItem` records that rollout consumes.

Bad rows (a line that is not UTF-8, malformed or too deeply nested JSON, a missing or wrongly
typed field) never crash a run on their own: they are collected with their line numbers, skipped,
and reported in one warning. Only a file with no usable row raises (`DataError`, listing the first
few bad rows with their line numbers), as does a file that cannot be read at all (missing, or a
damaged parquet file).
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rlloom.config import UserError
from rlloom.data.images import ImageInputs, image_problem, row_image_refs

logger = logging.getLogger(__name__)

Message = dict[str, Any]
"""A chat message: {"role": "system" | "user" | "assistant" | "tool", "content": text}, or content as a
list of parts `{"type": "text", "text": ...}` and `{"type": "image", "image": path}` (data/images.py)."""

ROLES = ("system", "user", "assistant", "tool")
"""The roles a row's chat message may have. Anything else is refused: a template may write the role
next to its turn markers (or build a control token from it, `'<|' + role + '|>'`), so a free-form
role from the data could forge chat structure."""

FileFormat = Literal["jsonl", "parquet"]

_NUM_LISTED = 5  # bad rows listed by line number in errors and warnings


class DataError(UserError):
    """A dataset file that cannot be used: missing, unreadable, or without a single usable row."""


@dataclass(kw_only=True, slots=True)
class RawPrompt:
    """A prompt before templating and tokenization, from a file or a procedural task.

    Example: `RawPrompt(prompt="What is 2 + 3? Answer with just the number.", ground_truth="5",
    index=0, metadata={"task": "arithmetic"})`.
    """

    prompt: str | list[Message]
    """The user text, or a list of chat messages."""
    ground_truth: str
    """What the reward function compares the response with (JSON text for structured answers)."""
    index: int
    """Position in the source: the row of a file (0-based, blank lines not counted) or the item of a
    generated task."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Every field of the row (the prompt and answer included, as the row holds them: reward
    functions get each under its own name), or task details (operands, solution)."""
    images: tuple[str, ...] = ()
    """The row's picture files in prompt order (relative paths resolved against the data file's folder)."""


@dataclass(kw_only=True, slots=True)
class PromptItem:
    """A templated, tokenized prompt ready for rollout.

    Example: `PromptItem(prompt_ids=[1, 504, 30], prompt_text="<|im_start|>user\\nWhat is 2 + 3?...",
    ground_truth="5", index=0)`.
    """

    prompt_ids: list[int]
    """Token ids of `prompt_text` (no special tokens added beyond what the template writes)."""
    prompt_text: str
    """The exact text that was encoded: the chat template's output, or the raw prompt."""
    ground_truth: str
    """What the reward function compares the response with."""
    index: int
    """Position in the source (see `RawPrompt.index`)."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Every field of the row, or task details; plug-in reward functions get each by name."""
    prompt: str | list[Message] = ""
    """The prompt as the row holds it (text or chat messages); reward functions get it as `prompt`."""
    images: ImageInputs | None = None
    """The row's pictures as the model's image processor wrote them (`prompt_ids` then hold one
    placeholder token per merged patch of each); None for a text prompt."""


@dataclass(frozen=True, slots=True)
class BadRow:
    """A row that was skipped, with its 1-based line (jsonl) or row (parquet) number."""

    line: int
    reason: str


def load_prompt_file(
    path: str | Path,
    *,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    file_format: FileFormat | None = None,
) -> list[RawPrompt]:
    """Read a jsonl or parquet file of prompts; bad rows are skipped with one warning.

    `file_format` None picks by the file suffix (`.parquet` -> parquet, anything else -> jsonl).
    Raises DataError when the file is missing, unreadable or holds no usable row.
    A run reads its file three times (the start-up check, the training split, the evaluation
    split): the rows of the last file read are kept, keyed by its size and modification time, so it
    is parsed (and its bad rows reported) once.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(
            f"data.path={str(path)!r} is not a file; fix: point data.path at a .jsonl or .parquet file"
        )
    fmt = file_format or ("parquet" if path.suffix == ".parquet" else "jsonl")
    stat = path.stat()
    return list(_parsed(str(path), stat.st_size, stat.st_mtime_ns, fmt, prompt_key, answer_key))


@functools.lru_cache(maxsize=1)
def _parsed(
    path: str, _size: int, _mtime_ns: int, fmt: FileFormat, prompt_key: str, answer_key: str
) -> tuple[RawPrompt, ...]:
    """The usable rows of the last file parsed (its size and modification time in the key: a
    changed file is parsed again)."""
    numbered = file_rows(Path(path), fmt)
    unit = "row" if fmt == "parquet" else "line"
    prompts: list[RawPrompt] = []
    bad: list[BadRow] = []
    for index, (line, row) in enumerate(numbered):
        if isinstance(row, BadRow):
            bad.append(row)
            continue
        parsed = parse_row(
            row, index=index, prompt_key=prompt_key, answer_key=answer_key, base=Path(path).parent
        )
        if not isinstance(parsed, str):
            parsed = _checked_images(parsed, Path(path), f"{unit} {line}")
        if isinstance(parsed, str):
            bad.append(BadRow(line, parsed))
        else:
            prompts.append(parsed)
    _report_bad_rows(
        Path(path),
        bad,
        total=len(prompts) + len(bad),
        unit=unit,
        prompt_key=prompt_key,
        answer_key=answer_key,
    )
    return tuple(prompts)


def _checked_images(prompt: RawPrompt, path: Path, where: str) -> RawPrompt | str:
    """The prompt when Pillow reads each of its pictures (else the reason: a bad row); DataError for a
    missing picture file, which stops the start-up."""
    for image in map(Path, prompt.images):
        if not image.is_file():
            raise DataError(
                f"data.path={str(path)!r} {where} names image {str(image)!r}, which is not a file (relative "
                f"paths are read from {str(path.parent)!r}). Fix: correct the path or put the picture there"
            )
        problem = image_problem(image)
        if problem:
            return problem
    return prompt


def parse_row(
    row: object, *, index: int, prompt_key: str, answer_key: str, base: Path = Path(".")
) -> RawPrompt | str:
    """One decoded row as a `RawPrompt`, or the reason it is unusable (`base`: the folder relative
    image paths are read from)."""
    if not isinstance(row, dict):
        return f"row is a {type(row).__name__}, not an object"
    if prompt_key not in row:
        return f"missing prompt field {prompt_key!r} (fields: {sorted(row)[:8]})"
    if answer_key not in row:
        return f"missing answer field {answer_key!r} (fields: {sorted(row)[:8]})"
    if row[answer_key] is None:
        return f"answer field {answer_key!r} is null"
    if isinstance(row[answer_key], str) and not row[answer_key].strip():
        return f"answer field {answer_key!r} is empty"  # nothing to score against: `\boxed{}` matched it
    prompt = row[prompt_key]
    problem = _prompt_problem(prompt)
    if problem:
        return problem
    refs = row_image_refs(row, prompt)
    if isinstance(refs, str):
        return refs
    return RawPrompt(
        prompt=prompt,
        ground_truth=ground_truth_text(row[answer_key]),
        index=index,
        metadata=row,
        images=tuple(str(base / ref) for ref in refs),
    )


def ground_truth_text(answer: object) -> str:
    """A ground truth as text: strings as they are, numbers and structures as JSON."""
    return answer if isinstance(answer, str) else json.dumps(answer)


def _prompt_problem(prompt: object) -> str:
    """Why `prompt` is not a usable prompt, or '' when it is."""
    if isinstance(prompt, str):
        return "" if prompt.strip() else "prompt is an empty string"
    if isinstance(prompt, list) and prompt:
        for i, message in enumerate(prompt):
            if not (
                isinstance(message, dict)
                and isinstance(message.get("role"), str)
                and (isinstance(message.get("content"), str) or _parts(message.get("content")))
            ):
                return f"prompt message {i} is not a {{role, content}} object of strings (or text and image parts)"
            if message["role"] not in ROLES:
                return f"prompt message {i} has role {message['role'][:40]!r}, not one of {', '.join(ROLES)}"
        return ""
    return f"prompt must be a non-empty string or list of {{role, content}} messages, got {type(prompt).__name__}"


def _parts(content: object) -> bool:
    """Content as a non-empty list of `{"type": "text", "text": str}` and `{"type": "image", ...}` parts."""
    return (
        isinstance(content, list)
        and bool(content)
        and all(
            isinstance(p, dict)
            and (p.get("type") == "image" or (p.get("type") == "text" and isinstance(p.get("text"), str)))
            for p in content
        )
    )


def file_rows(path: Path, fmt: FileFormat) -> list[tuple[int, object]]:
    """(line or row number, decoded object or BadRow) for each row of a jsonl or parquet file."""
    return _parquet_rows(path) if fmt == "parquet" else _jsonl_rows(path)


def _jsonl_rows(path: Path) -> list[tuple[int, object]]:
    """(line number, decoded object or BadRow) for each non-blank line."""
    rows: list[tuple[int, object]] = []
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            rows.extend([(line_no, _decode_line(raw, line_no))] if raw.strip() else [])
    return rows


def _decode_line(raw: bytes, line_no: int) -> object:
    """One jsonl line as a decoded object, or the BadRow saying why it is not one."""
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        return BadRow(line_no, f"not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1})")
    except json.JSONDecodeError as e:
        return BadRow(line_no, f"malformed JSON ({e.msg} at column {e.colno})")
    except RecursionError:
        return BadRow(line_no, "JSON nested too deeply to read")


def _parquet_rows(path: Path) -> list[tuple[int, object]]:
    """(row number, row dict) for each row of a parquet file."""
    try:
        import pyarrow
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            f"data.path={str(path)!r} is a parquet file, which needs pyarrow; "
            "fix: `pip install rlloom[parquet]` (or convert the file to jsonl)"
        ) from None
    try:
        table = pq.read_table(path)
    except (pyarrow.ArrowException, OSError) as e:
        reason = " ".join(str(e).split())[:200]
        raise DataError(
            f"data.path={str(path)!r} is not a readable parquet file ({type(e).__name__}: {reason}); "
            "fix: rewrite the file (it may be truncated) or convert it to jsonl"
        ) from None
    return list(enumerate(table.to_pylist(), start=1))


def _report_bad_rows(
    path: Path, bad: list[BadRow], *, total: int, unit: str, prompt_key: str, answer_key: str
) -> None:
    """Raise when every row is bad; warn once with counts and line numbers when some are."""
    listed = "; ".join(f"{unit} {b.line}: {b.reason}" for b in bad[:_NUM_LISTED])
    if total == 0:
        raise DataError(f"data.path={str(path)!r} holds no rows; fix: point data.path at a non-empty dataset")
    if len(bad) == total:
        raise DataError(
            f"data.path={str(path)!r}: all {total} rows are unusable (each needs a prompt under "
            f"data.prompt_key={prompt_key!r} and a ground truth under data.answer_key={answer_key!r}); "
            f"first: {listed}. Fix: correct the file or set data.prompt_key / data.answer_key"
        )
    if bad:
        more = f" (and {len(bad) - _NUM_LISTED} more)" if len(bad) > _NUM_LISTED else ""
        logger.warning("%s: skipped %d of %d rows: %s%s", path, len(bad), total, listed, more)
