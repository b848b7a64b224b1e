"""The OpenAI wire format: a request body checked into a `GenRequest` (or an `ApiError` with the
OpenAI-style 4xx body naming the field), and a generation's `Choice`s written back as a chat
completion or a completion, whole or as server-sent-event chunks sent while it is generated.

Only what the engine can honour is accepted: text content (a list of text parts is joined), tools and
`tool_choice` (calls are parsed from the response with `rollout.tool_parser`'s format; "none": not
parsed; "required" or a named function: the answer starts with that format's call opening, written
after the prompt (`turns.render_prompt`), so the model writes a call's arguments; its JSON is the
model's, not constrained), temperature, top_p, max_tokens /
max_completion_tokens, stop, n, seed, logprobs (the sampled tokens' own; `top_logprobs` > 0 is
refused), stream (with `stream_options.include_usage`). Fields the engine has no use for (`user`,
penalties, `response_format`, ...) are ignored, as most OpenAI-compatible servers do.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from rlloom.episodes.tools import ToolCall
from rlloom.episodes.types import Message

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_N = 64
"""Most choices of one request (the engine samples them as one prompt's samples)."""


class ApiError(Exception):
    """A request the endpoint refuses: its HTTP status and the OpenAI-style error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        if self.status == 404:
            kind = "not_found_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True, slots=True)
class GenRequest:
    """One checked request. Example: `GenRequest(kind="chat", messages=[{"role": "user", "content":
    "2+2?"}], max_tokens=16)`."""

    kind: Literal["chat", "completion"]
    messages: list[Message] | None = None
    """Chat: the conversation, normalised for the chat template (tool-call arguments as dicts)."""
    prompt: str | list[int] | None = None
    """Completion: the prompt text, or its token ids."""
    tools: list[dict[str, Any]] | None = None
    parse_tools: bool = False
    """Parse tool calls out of the response (tools given and tool_choice is not "none")."""
    force_tool: str | None = None
    """`tool_choice` "required" ("") or a named function (its name): the answer starts with the
    opening of a call (of that function), written after the prompt, so it is a call; None: the model
    chooses ("auto") or calls none ("none": calls are not parsed)."""
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    n: int = 1
    seed: int | None = None
    logprobs: bool = False
    stream: bool = False
    include_usage: bool = False


@dataclass(kw_only=True, slots=True)
class Choice:
    """One generated answer: its sampled ids (those kept: a `stop` string cuts the rest), their
    logprobs and text pieces, the content and the tool calls parsed from it."""

    token_ids: list[int]
    logprobs: list[float]
    pieces: list[str]
    """Each kept token's text (what the stream sends as deltas)."""
    text: str
    """The content: the response's text (without the stop string or the final stop token)."""
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str = "stop"
    """"stop", "length" or "tool_calls"."""


@dataclass(frozen=True, slots=True)
class Delta:
    """Tokens of choice `index` sampled since the last delta (a streaming request's progress)."""

    index: int
    pieces: list[str]
    logprobs: list[float]


@dataclass(kw_only=True, slots=True)
class Answer:
    """What a request gets back: its choices and its prompt's token count."""

    choices: list[Choice]
    prompt_tokens: int


# ---- requests ------------------------------------------------------------------------------------


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


def _number(body: dict, name: str, low: float, high: float, *, low_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(f"'{name}' must be a number, not {value!r}", name)
    if value < low or value > high or (low_open and value == low):
        raise _bad(
            f"'{name}'={value!r} is out of range: it must be in {'(' if low_open else '['}{low}, {high}]",
            name,
        )
    return float(value)


def _int(body: dict, name: str, low: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise _bad(f"'{name}' must be an integer >= {low}, not {value!r}", name)
    return value


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise _bad(f"'stop' must be a non-empty string or a list of up to 4 of them, not {stop!r}", "stop")
    return tuple(stops)


def _common(body: dict) -> dict[str, Any]:
    """The sampling fields chat and completions share."""
    n = _int(body, "n", 1) or 1
    if n > MAX_N:
        raise _bad(f"'n'={n} is more than {MAX_N} choices in one request", "n")
    max_tokens = _int(body, "max_completion_tokens", 1) or _int(body, "max_tokens", 1)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad(f"'stream' must be a boolean, not {stream!r}", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise _bad(f"'stream_options' must be an object, not {options!r}", "stream_options")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise _bad(f"'seed' must be an integer, not {seed!r}", "seed")
    return dict(
        temperature=_number(body, "temperature", 0.0, 2.0),
        top_p=_number(body, "top_p", 0.0, 1.0, low_open=True),
        max_tokens=max_tokens,
        stop=_stop(body),
        n=n,
        seed=seed,
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
    )


def _content(value: Any, where: str) -> str:
    """A message's content as text: a string, None (an assistant message with tool calls) or a list
    of text parts."""
    if value is None or isinstance(value, str):
        return value or ""
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in value):
        return "".join(str(p.get("text", "")) for p in value)
    raise _bad(f"{where}.content must be a string or a list of text parts (only text is served)", where)


def _tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's tool calls as chat templates read them (arguments as a dict)."""
    if not isinstance(value, list):
        raise _bad(f"{where}.tool_calls must be a list", where)
    out = []
    for call in value:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad(f"{where}.tool_calls entries need function.name", where)
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise _bad(
                    f"{where}.tool_calls: arguments of {fn['name']!r} are not JSON ({e.msg})", where
                ) from e
        out.append({"type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def normalize_messages(messages: Any) -> list[Message]:
    """The request's messages as the chat template renders them; `developer` reads as `system`."""
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list of messages", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise _bad(f"{where} must be an object with a role in {list(ROLES)}", where)
        role = "system" if m["role"] == "developer" else m["role"]
        message: Message = {"role": role, "content": _content(m.get("content"), where)}
        if role == "assistant" and m.get("tool_calls"):
            message["tool_calls"] = _tool_calls(m["tool_calls"], where)
        for key in ("name", "tool_call_id"):
            if isinstance(m.get(key), str):
                message[key] = m[key]
        out.append(message)
    return out


def _tools(body: dict) -> tuple[list[dict[str, Any]] | None, bool, str | None]:
    """The tools, whether calls are parsed from the answer, and the call `tool_choice` forces ("":
    any tool, "required"; a name: that function; None: the model chooses)."""
    tools = body.get("tools")
    tools = None if tools == [] else tools
    if tools is not None and (
        not isinstance(tools, list)
        or not all(
            isinstance(t, dict)
            and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str)
            for t in tools
        )
    ):
        raise _bad("'tools' must be a list of {'type': 'function', 'function': {'name': ...}}", "tools")
    choice = body.get("tool_choice")
    if choice is None:
        return tools, tools is not None, None
    named = isinstance(choice, dict) and isinstance((choice.get("function") or {}).get("name"), str)
    if choice not in ("none", "auto", "required") and not (
        named and choice.get("type", "function") == "function"
    ):
        raise _bad(
            "'tool_choice' must be 'none', 'auto', 'required' or "
            f"{{'type': 'function', 'function': {{'name': ...}}}}, not {choice!r}",
            "tool_choice",
        )
    if tools is None and choice != "none":
        raise _bad(
            f"'tool_choice'={choice!r} needs 'tools': give the functions the model may call", "tool_choice"
        )
    if named and choice["function"]["name"] not in [t["function"]["name"] for t in tools]:
        raise _bad(
            f"'tool_choice' names {choice['function']['name']!r}, which is not one of 'tools'", "tool_choice"
        )
    force = choice["function"]["name"] if named else "" if choice == "required" else None
    return tools, tools is not None and choice != "none", force


def parse_chat(body: Any) -> GenRequest:
    """A `/v1/chat/completions` body checked (ApiError naming the field otherwise)."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    logprobs = body.get("logprobs", False) or False
    if not isinstance(logprobs, bool):
        raise _bad(f"'logprobs' must be a boolean, not {logprobs!r}", "logprobs")
    if body.get("top_logprobs"):
        raise _bad(
            "'top_logprobs' > 0 is not served: the engine records each sampled token's logprob only",
            "top_logprobs",
        )
    tools, parse_tools, force_tool = _tools(body)
    messages = normalize_messages(body.get("messages"))
    return GenRequest(
        kind="chat",
        messages=messages,
        tools=tools,
        parse_tools=parse_tools,
        force_tool=force_tool,
        logprobs=logprobs,
        **_common(body),
    )


def parse_completion(body: Any) -> GenRequest:
    """A `/v1/completions` body checked: `prompt` is one string or one list of token ids."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    ids = isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt
    )
    if not (isinstance(prompt, str) and prompt) and not (ids and prompt):
        raise _bad("'prompt' must be one non-empty string or one non-empty list of token ids", "prompt")
    logprobs = body.get("logprobs")
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0):
        raise _bad(f"'logprobs' must be a non-negative integer, not {logprobs!r}", "logprobs")
    if logprobs:
        raise _bad(
            "'logprobs' > 0 (top alternatives) is not served; use logprobs=0 for the sampled tokens'",
            "logprobs",
        )
    if body.get("echo"):
        raise _bad("'echo' is not served", "echo")
    return GenRequest(kind="completion", prompt=prompt, logprobs=logprobs == 0, **_common(body))


# ---- responses -----------------------------------------------------------------------------------


def _call_entry(call: ToolCall, k: int) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
        **({"index": k} if k >= 0 else {}),
    }


def _chat_logprobs(c: Choice) -> dict[str, Any]:
    return {
        "content": [
            {"token": p, "logprob": lp, "bytes": list(p.encode()), "top_logprobs": []}
            for p, lp in zip(c.pieces, c.logprobs)
        ]
    }


def _usage(answer: Answer) -> dict[str, int]:
    completion = sum(len(c.token_ids) for c in answer.choices)
    return {
        "prompt_tokens": answer.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": answer.prompt_tokens + completion,
    }


def chat_response(req: GenRequest, answer: Answer, *, model: str) -> dict[str, Any]:
    choices = []
    for i, c in enumerate(answer.choices):
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        if c.tool_calls:
            message["tool_calls"] = [_call_entry(t, -1) for t in c.tool_calls]
        choices.append(
            {
                "index": i,
                "message": message,
                "finish_reason": c.finish_reason,
                "logprobs": _chat_logprobs(c) if req.logprobs else None,
            }
        )
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": _usage(answer),
    }


def completion_response(req: GenRequest, answer: Answer, *, model: str) -> dict[str, Any]:
    choices = []
    for i, c in enumerate(answer.choices):
        logprobs = None
        if req.logprobs:
            logprobs = {
                "tokens": c.pieces,
                "token_logprobs": c.logprobs,
                "top_logprobs": None,
                "text_offset": [],
            }
        choices.append({"index": i, "text": c.text, "finish_reason": c.finish_reason, "logprobs": logprobs})
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": _usage(answer),
    }


def _event(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def stream_events(
    req: GenRequest, events: AsyncIterator[Delta | Answer], *, model: str
) -> AsyncIterator[str]:
    """The request as server-sent events while it is generated: each choice's role, then a chunk
    per token (its text piece and logprob) of every `Delta`, then at the `Answer` the rest of each
    choice's content (a chunk per token when its pieces make the content, else one chunk), its tool
    calls and finish reason, the usage when asked, and `[DONE]`."""
    chat = req.kind == "chat"
    head = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
    }

    def chunk(i: int, delta: dict[str, Any], finish: str | None, lp: dict[str, Any] | None) -> str:
        if chat:
            body = {"index": i, "delta": delta, "finish_reason": finish, "logprobs": lp}
        else:
            body = {"index": i, "text": delta.get("content", ""), "finish_reason": finish, "logprobs": lp}
        return _event({**head, "choices": [body]})

    def tokens(i: int, pieces: list[str], lps: list[float | None]) -> Iterator[str]:
        for piece, lp in zip(pieces, lps):
            logprobs = None
            if req.logprobs and lp is not None:
                one = Choice(token_ids=[], logprobs=[lp], pieces=[piece], text=piece)
                logprobs = _chat_logprobs(one) if chat else {"tokens": [piece], "token_logprobs": [lp]}
            if piece or logprobs:
                yield chunk(i, {"content": piece}, None, logprobs)

    sent_tokens, sent_text = [0] * req.n, [""] * req.n
    if chat:
        for i in range(req.n):
            yield chunk(i, {"role": "assistant", "content": ""}, None, None)
    async for event in events:
        if isinstance(event, Delta):
            sent_tokens[event.index] += len(event.pieces)
            sent_text[event.index] += "".join(event.pieces)
            for line in tokens(event.index, event.pieces, list(event.logprobs)):
                yield line
            continue
        for i, c in enumerate(event.choices):
            k, sent = sent_tokens[i], sent_text[i]
            # The pieces add up to the content only without parsed tool calls (cut out of it) or a
            # forced call's opening (written by the prompt).
            if "".join(c.pieces) == c.text and "".join(c.pieces[:k]) == sent:
                for line in tokens(i, c.pieces[k:], list(c.logprobs[k:])):
                    yield line
            elif c.text[len(sent) :]:
                yield chunk(i, {"content": c.text[len(sent) :]}, None, None)
            if c.tool_calls:
                calls = [_call_entry(t, k) for k, t in enumerate(c.tool_calls)]
                yield chunk(i, {"tool_calls": calls}, None, None)
            yield chunk(i, {}, c.finish_reason, None)
        if req.include_usage:
            yield _event({**head, "choices": [], "usage": _usage(event)})
        break
    yield "data: [DONE]\n\n"
