"""One request's way through the model: its prompt as the chat template renders it (or the
completion's text or ids), and the engine's sampled tokens back as an OpenAI `Choice` (the content
the run's response decoding gives, a request's `stop` string and what follows it cut off, tool calls
parsed as in multi-turn episodes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlloom.agents.api import Choice, GenRequest
from rlloom.data.control_tokens import ResponseDecoder
from rlloom.episodes.render import Rendered, encode, render_conversation
from rlloom.episodes.tools import TOOL_OPENINGS, TOOL_PARSERS, strip_tool_calls


@dataclass(frozen=True, slots=True)
class Formats:
    """How the served model reads and writes text."""

    tokenizer: Any
    decode: ResponseDecoder
    """The run's response decoding: control tokens inside a response visible, a final one left out."""
    tool_parser: str = "hermes"
    renders_tool_calls: bool = False
    """The chat template writes an assistant message's `tool_calls` itself (Qwen's does): the content
    given back then holds only the text around the calls, so the next request renders the same text."""

    @classmethod
    def of(cls, tokenizer: Any, tool_parser: str = "hermes") -> Formats:
        template = getattr(tokenizer, "chat_template", "") or ""
        return cls(
            tokenizer=tokenizer,
            decode=ResponseDecoder.of(tokenizer),
            tool_parser=tool_parser,
            renders_tool_calls="tool_calls" in template,
        )


def opening(fmt: Formats, req: GenRequest) -> str:
    """The text a forced `tool_choice` writes at the start of the answer ("" when none is forced)."""
    return "" if req.force_tool is None else TOOL_OPENINGS[fmt.tool_parser](req.force_tool)


def render_prompt(fmt: Formats, req: GenRequest) -> Rendered | list[int]:
    """What the model reads: the rendered conversation (chat) and a forced call's opening (the
    template's own text, unmarked), the prompt text, or its ids."""
    if req.kind == "chat":
        rendered = render_conversation(fmt.tokenizer, req.messages, tools=req.tools)
        return Rendered(rendered.marked + opening(fmt, req))
    if isinstance(req.prompt, list):
        return list(req.prompt)
    return Rendered(req.prompt)  # unmarked: a raw prompt's control-token strings are the model's own


def prompt_ids(fmt: Formats, prompt: Rendered | list[int]) -> list[int]:
    return list(prompt) if isinstance(prompt, list) else encode(fmt.tokenizer, prompt)


def _kept(fmt: Formats, ids: list[int], text: str) -> list[int]:
    """The longest head of `ids` whose text is a head of `text` (the tokens before a stop string)."""
    for m in range(len(ids), -1, -1):
        if text.startswith(fmt.tokenizer.decode(ids[:m], skip_special_tokens=False)):
            return ids[:m]
    return []


def pieces(fmt: Formats, ids: list[int]) -> list[str]:
    """Each token's text, so that the pieces add up to the decoded text (a token that ends inside a
    multi-byte character gets "", the next one the character); a final control token gets ""."""
    body = fmt.decode.body(ids)
    out, prev = [], ""
    for k in range(len(body)):
        text = fmt.tokenizer.decode(body[: k + 1], skip_special_tokens=False)
        if text.endswith("\ufffd"):
            out.append("")
            continue
        out.append(text[len(prev) :])
        prev = text
    return out + [""] * (len(ids) - len(body))


def make_choice(
    fmt: Formats, req: GenRequest, token_ids: list[int], logprobs: list[float], finish_reason: str
) -> Choice:
    """The engine's sampled tokens as a `Choice`. A request's `stop` string ends the content there
    (OpenAI's rule: the stop string is not returned) and only the tokens before it are kept: those
    are what the model reads back when the agent sends the conversation again."""
    ids, lps = list(token_ids), list(logprobs)
    text = fmt.decode(ids)
    cuts = [text.find(s) for s in req.stop if s in text]
    if cuts and finish_reason == "stop":
        text = text[: min(cuts)]
        ids = _kept(fmt, ids, text)
        lps = lps[: len(ids)]
    calls = []
    text = opening(fmt, req) + text  # a forced call's opening is the answer's, written by the prompt
    if req.parse_tools:
        calls, _ = TOOL_PARSERS[fmt.tool_parser](text)
    choice = Choice(
        token_ids=ids,
        logprobs=lps,
        pieces=pieces(fmt, ids) if req.stream or req.logprobs else [],
        text=strip_tool_calls(text) if calls and fmt.renders_tool_calls else text,
        tool_calls=calls,
        finish_reason="tool_calls" if calls and finish_reason == "stop" else finish_reason,
    )
    return choice


@dataclass(kw_only=True, slots=True)
class StreamCursor:
    """What of one streaming choice's tokens so far may be sent before it finishes: every token
    but the newest (it may be the final stop token, whose text is left out), up to where a request's
    `stop` string may begin (the content ends before it) and, when tool calls are cut out of the
    content (`Formats.renders_tool_calls`), up to where a call may begin and without the whitespace
    the content's strip would drop (an answer that starts with whitespace, or a forced call, is sent
    at its end). The pieces sent are those `pieces` gives for the finished choice."""

    fmt: Formats
    req: GenRequest
    sent: int = 0
    """Tokens sent."""
    text: str = ""
    """Their text (the pieces sent, joined)."""

    def advance(self, token_ids: list[int], logprobs: list[float]) -> tuple[list[str], list[float]]:
        """The pieces (and logprobs) of the tokens that may be sent now and were not sent before."""
        ids = token_ids[:-1]
        if len(ids) <= self.sent or self.req.force_tool is not None:
            return [], []
        decode = self.fmt.tokenizer.decode
        limit = self._safe(decode(ids, skip_special_tokens=False))
        out, lps = [], []
        for k in range(self.sent, len(ids)):
            text = decode(ids[: k + 1], skip_special_tokens=False)
            piece = "" if text.endswith("\ufffd") else text[len(self.text) :]
            if len(self.text) + len(piece) > limit:
                break
            out.append(piece)
            lps.append(logprobs[k])
            self.text += piece
            self.sent = k + 1
        return out, lps

    def _safe(self, text: str) -> int:
        """How much of `text` (the tokens so far) the finished content surely starts with."""
        strips = self.req.parse_tools and self.fmt.renders_tool_calls
        if strips and text[:1].isspace():
            return 0
        marks = [*self.req.stop, *([TOOL_OPENINGS[self.fmt.tool_parser]("").strip()] if strips else [])]
        cut = len(text)
        for mark in marks:
            at = text.find(mark)
            if at >= 0:
                cut = min(cut, at)
                continue
            held = next(
                (n for n in range(min(len(mark) - 1, len(text)), 0, -1) if text.endswith(mark[:n])), 0
            )
            cut = min(cut, len(text) - held)
        return len(text[:cut].rstrip()) if strips else cut


def assistant_message(choice: Choice) -> dict[str, Any]:
    """The assistant message the choice adds to the conversation (samples.jsonl's `messages`)."""
    message: dict[str, Any] = {"role": "assistant", "content": choice.text}
    if choice.tool_calls:
        message["tool_calls"] = [c.as_message_entry() for c in choice.tool_calls]
    return message
