"""Tools for the policy to call: plain Python functions (`rollout.tools: ["module:function"]`), their
JSON schemas (from the signature and the Google-style docstring, by transformers' `get_json_schema`,
rendered by the tokenizer's chat template through `tools=`), the parsers that find calls in a
response (one per model family's format), and `ToolEnv`, the built-in environment that runs the
calls until the model answers without one.

A malformed call, an unknown tool, bad arguments, a tool that raises, hangs past
`rollout.tool_timeout_s` or returns something that is not text (or a number, or JSON-able data) is
not a crash: the model gets an error message as the tool's output and `rollout/tool_errors` counts it.
"""

from __future__ import annotations

import json
import re
import signal
import threading
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from rlloom.episodes.types import EnvStep, Message

# Qwen2.5 / Qwen3 / Hermes: <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One parsed call. Example: `ToolCall(name="add", arguments={"a": 1, "b": 2})`."""

    name: str
    arguments: dict[str, Any]

    def as_message_entry(self) -> dict[str, Any]:
        """The OpenAI-style `tool_calls` entry of the assistant message (what chat templates render)."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parse_hermes(text: str) -> tuple[list[ToolCall], list[str]]:
    """The calls in `text` written as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, and
    an error message for each block that is not such a call."""
    calls, errors = [], []
    for body in _HERMES.findall(text):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            errors.append(f"the tool call {body.strip()[:200]!r} is not valid JSON ({e.msg})")
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            errors.append(f"the tool call {body.strip()[:200]!r} has no string `name`")
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            errors.append(f"the tool call to {obj['name']!r} has arguments that are not a JSON object")
            continue
        calls.append(ToolCall(name=obj["name"], arguments=args))
    return calls, errors


def strip_tool_calls(text: str) -> str:
    """`text` without its `<tool_call>` blocks (the content of an assistant message whose calls are
    given as `tool_calls`)."""
    return _HERMES.sub("", text).strip()


def hermes_opening(name: str) -> str:
    """The start of a call in the Hermes format: of function `name`, or of any ("")."""
    return "<tool_call>\n" + (f'{{"name": {json.dumps(name)}, "arguments": ' if name else "")


TOOL_PARSERS: dict[str, Callable[[str], tuple[list[ToolCall], list[str]]]] = {"hermes": parse_hermes}
"""`rollout.tool_parser` -> parser; a family with another format adds one function and one entry
here and in `TOOL_OPENINGS`."""
TOOL_OPENINGS: dict[str, Callable[[str], str]] = {"hermes": hermes_opening}
"""`rollout.tool_parser` -> the text that starts a call (what a forced `tool_choice` writes)."""


def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The OpenAI-style function schema of `fn`; raises ValueError when it cannot be derived (no
    docstring, an argument without a type hint or a description)."""
    from transformers.utils import get_json_schema  # the heavy import only where tools are used

    try:
        return get_json_schema(fn)
    except Exception as e:  # noqa: BLE001 - transformers raises several types; all mean the same
        raise ValueError(
            f"cannot derive the JSON schema of {getattr(fn, '__name__', fn)!r} ({e}); give it type hints "
            "and a Google-style docstring with an `Args:` entry per argument"
        ) from e


def _text(value: object) -> str:
    """A tool's return value as the text the model reads."""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float, bool)) or value is None:
        return json.dumps(value)
    try:
        return json.dumps(value)
    except (TypeError, ValueError) as e:
        raise TypeError(f"returned {type(value).__name__}, which is not text or JSON data") from e


@contextmanager
def _time_limit(seconds: float):  # noqa: ANN202 - a context manager
    """Raise TimeoutError in this thread after `seconds` (SIGALRM: main thread of a worker only;
    elsewhere no limit is set here and the caller's own timeout applies)."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: object) -> None:
        raise TimeoutError(f"did not return within {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_tool(tools: dict[str, Callable[..., Any]], call: ToolCall, *, timeout_s: float) -> tuple[str, bool]:
    """(the tool message's text, whether it is an error) for one call."""
    fn = tools.get(call.name)
    if fn is None:
        return f"Error: unknown tool {call.name!r}; available: {', '.join(sorted(tools))}", True
    try:
        with _time_limit(timeout_s):
            return _text(fn(**call.arguments)), False
    except TimeoutError as e:
        return f"Error: tool {call.name!r} {e}", True
    except Exception as e:  # noqa: BLE001 - the model reads the error; the run goes on
        return f"Error: tool {call.name!r} failed: {type(e).__name__}: {e}"[:1000], True


class ToolEnv:
    """The environment `rollout.tools` without `rollout.env` runs: each assistant message's tool
    calls are executed and their results appended as `tool` messages; the trajectory ends when the
    model answers without a call (the configured reward function then scores the conversation)."""

    def __init__(self, tools: dict[str, Callable[..., Any]], *, parser: str, timeout_s: float) -> None:
        self.tools, self.parse, self.timeout_s = tools, TOOL_PARSERS[parser], timeout_s

    def reset(self, row: dict[str, Any]) -> None:
        return None

    def step(self, messages: list[Message], state: dict[str, Any]) -> EnvStep:
        last = messages[-1]
        calls, errors = self.parse(last["content"])
        if not calls and not errors:
            return EnvStep(done=True)
        observations = [{"role": "tool", "content": f"Error: {e}"} for e in errors]
        num_errors = len(errors)
        for call in calls:
            text, failed = run_tool(self.tools, call, timeout_s=self.timeout_s)
            observations.append({"role": "tool", "content": text})
            num_errors += failed
        return EnvStep(
            observations=observations,
            metrics={"tool_calls": float(len(calls) + len(errors)), "tool_errors": float(num_errors)},
        )
