"""Conversations for supervised fine-tuning (`rlloom sft`): rows of a jsonl or parquet file, each
holding a list of chat messages under `data.messages_key`, e.g.

    {"messages": [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}]}

Every row is checked before anything heavy loads, and a bad one stops the start-up (`DataError`,
one line listing the first bad rows by line number): RL's prompt files skip bad rows with a warning,
but a conversation trains every token its assistant wrote, so a silently dropped row would be a
silently different fine-tune. A row must be an object whose messages are a non-empty list of
{role, content} objects of strings, roles among `ROLES`, starting with a system or user message
and holding at least one assistant message (the tokens trained on).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rlloom.data.dataset import ROLES, BadRow, DataError, FileFormat, Message, file_rows

_NUM_LISTED = 3  # bad rows named in the error


@dataclass(frozen=True, slots=True)
class Conversation:
    """One row's chat messages. Example: `Conversation(messages=[{"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"}], line=1)`."""

    messages: list[Message]
    """The messages in order; the assistant's are trained on."""
    line: int
    """1-based line (jsonl) or row (parquet) number, for errors."""


def load_conversations(path: str | Path, *, messages_key: str, file_format: FileFormat) -> list[Conversation]:
    """Every row of the file as a `Conversation`; DataError at the first bad rows (see the module
    docstring), or when the file is missing, unreadable or empty."""
    path = Path(path)
    if not path.is_file():
        raise DataError(
            f"data.path={str(path)!r} is not a file; fix: point data.path at a .jsonl or .parquet file of "
            "chat conversations"
        )
    numbered = file_rows(path, file_format)
    if not numbered:
        raise DataError(f"data.path={str(path)!r} holds no rows; fix: point data.path at a non-empty dataset")
    unit = "row" if file_format == "parquet" else "line"
    objects = [(line, row) for line, row in numbered if isinstance(row, dict)]
    if objects and not any(messages_key in row for _, row in objects):
        line, row = objects[0]
        raise DataError(
            f"data.messages_key={messages_key!r}: no row of data.path={str(path)!r} has this field (fields of "
            f"{unit} {line}: {sorted(row)[:8]}). Fix: set data.messages_key to the field that holds each "
            "row's chat messages"
        )
    conversations: list[Conversation] = []
    bad: list[BadRow] = []
    for line, row in numbered:
        problem = row.reason if isinstance(row, BadRow) else conversation_problem(row, messages_key)
        if problem:
            bad.append(BadRow(line, problem))
        else:
            assert isinstance(row, dict)
            conversations.append(Conversation(messages=[dict(m) for m in row[messages_key]], line=line))
    if bad:
        listed = "; ".join(f"{unit} {b.line}: {b.reason}" for b in bad[:_NUM_LISTED])
        more = f" (and {len(bad) - _NUM_LISTED} more)" if len(bad) > _NUM_LISTED else ""
        raise DataError(
            f"data.path={str(path)!r}: {len(bad)} of {len(numbered)} rows are not chat conversations to "
            f"fine-tune on: {listed}{more}. Fix: correct or remove those rows (each needs a list of "
            f"{{role, content}} messages under data.messages_key={messages_key!r} with an assistant message)"
        )
    return conversations


def conversation_problem(row: object, messages_key: str) -> str:
    """Why `row` is not a conversation to fine-tune on, or '' when it is."""
    if not isinstance(row, dict):
        return f"row is a {type(row).__name__}, not an object"
    if messages_key not in row:
        return f"missing messages field {messages_key!r} (fields: {sorted(row)[:8]})"
    messages = row[messages_key]
    if not isinstance(messages, list) or not messages:
        got = "an empty list" if messages == [] else f"a {type(messages).__name__}"
        return f"messages must be a non-empty list of {{role, content}} messages, got {got}"
    for i, message in enumerate(messages):
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            return f"message {i} is not a {{role, content}} object of strings"
        if message["role"] not in ROLES:
            return f"message {i} has role {message['role'][:40]!r}, not one of {', '.join(ROLES)}"
    if messages[0]["role"] == "assistant":
        return "message 0 is an assistant message; a conversation starts with a system or user message"
    if not any(m["role"] == "assistant" for m in messages):
        return "no assistant message, so nothing to train on"
    return ""
