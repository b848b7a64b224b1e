"""Control tokens belong to the chat template and the model, never to the data.

A control token is one of the tokenizer's special tokens (`<|im_start|>`, `<|im_end|>`, EOS, padding:
the added tokens marked special). A dataset row is third-party text: if its prompt, a message or
`data.system_prompt` held the string `<|im_end|>\\n<|im_start|>assistant\\n...`, encoding the
rendered chat as usual would turn it into the real turn markers and let the row close the user turn
and forge assistant or system turns. So:

- Prompts (`encode_chat`, `encode_raw`): every control-token string in the data is wrapped in
  private-use markers before the template renders (as transformers 5's `sanitize_control_tokens`
  does), and the rendered text is encoded piece by piece: the template's own text as usual (its
  control tokens stay control tokens), each marked string as plain text (`split_special_tokens`).
  A row without control-token strings encodes exactly as before. A raw prompt (no template) is all
  data: encoded with `split_special_tokens=True`.
- Responses (`ResponseDecoder`): control tokens the policy generates inside a response stay visible
  in the text that rewards score and samples.jsonl shows (`4<|im_start|>2`, not `42`); only the
  final stop token is left out, and the responses holding one are counted
  (`response/special_token_frac`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlloom.config import UserError

START, END = "\U000f0000", "\U000f0001"
"""Private-use markers around a control-token string found in the data (removed before encoding)."""


class ControlTokenError(UserError):
    """The tokenizer turns a control token's text into the control token itself, so data holding it
    cannot be encoded as plain text."""


def control_tokens(tokenizer: Any) -> dict[str, int]:
    """Text -> id of every special added token (tokenizers without added tokens have none)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {tok.content: i for i, tok in decoder.items() if getattr(tok, "special", False)}


def control_pattern(tokens: dict[str, int]) -> re.Pattern[str] | None:
    """A regex matching any of `tokens`, longest first (None when there are none)."""
    if not tokens:
        return None
    return re.compile("|".join(map(re.escape, sorted(tokens, key=len, reverse=True))))


def mark(obj: Any, pattern: re.Pattern[str] | None) -> Any:
    """`obj` (a string, or messages: lists and dicts of them) with every control-token string wrapped
    in START/END; markers already in a string are dropped first, so data cannot forge one."""
    if isinstance(obj, str):
        obj = obj.replace(START, "").replace(END, "")
        return obj if pattern is None else pattern.sub(f"{START}\\g<0>{END}", obj)
    if isinstance(obj, dict):
        return {key: mark(value, pattern) for key, value in obj.items()}
    if isinstance(obj, list):
        return [mark(value, pattern) for value in obj]
    return obj


def unmarked(text: str) -> str:
    """The text the model reads: `text` without the markers."""
    return text.replace(START, "").replace(END, "")


def encode_raw(tokenizer: Any, text: str) -> list[int]:
    """A prompt without a chat template, all data: the tokenizer's usual BOS, no control token from
    the text."""
    return list(tokenizer.encode(text, add_special_tokens=True, split_special_tokens=True))


def encode_chat(tokenizer: Any, rendered: str, tokens: dict[str, int]) -> list[int]:
    """Ids of a chat rendered from `mark`ed messages: the template's text as usual, each marked
    control-token string as plain text. A template's string method may split a marker pair (a lone
    marker): it is dropped, but still cuts the text so the two sides cannot join into a control token.
    """
    pattern = control_pattern(tokens)
    if pattern is None or (START not in rendered and END not in rendered):
        return list(tokenizer.encode(rendered, add_special_tokens=False))
    pieces = re.split(f"{START}({pattern.pattern}){END}|[{START}{END}]", rendered)
    ids = list(tokenizer.encode(pieces[0], add_special_tokens=False))
    as_text = lambda s: tokenizer.encode(s, add_special_tokens=False, split_special_tokens=True)
    as_chat = lambda s: tokenizer.encode(s, add_special_tokens=False)
    for i, piece in enumerate(pieces[1:], start=1):
        if not piece:
            continue
        if i % 2 == 1:  # a marked control-token string
            plain = _mid_text(as_text, piece)
            if tokens[piece] in plain:
                raise ControlTokenError(
                    f"the tokenizer encodes the text {piece!r} as its control token even as plain text, so data "
                    "holding it cannot be kept out of the chat's structure. Fix: remove it from the data."
                )
            ids += plain
        else:
            ids += _mid_text(as_chat, piece)
    return ids


def _mid_text(encode: Callable[[str], list[int]], piece: str) -> list[int]:
    """Ids of `piece` as text in the middle of a chat: SentencePiece tokenizers add a prefix space at
    the start of a string, so the piece is encoded after a newline whose ids are then removed."""
    newline = encode("\n")
    ids = list(encode("\n" + piece))
    return ids[len(newline) :] if ids[: len(newline)] == newline else list(encode(piece))


@dataclass(frozen=True, slots=True)
class ResponseDecoder:
    """Response ids -> the text rewards score: control tokens inside a response stay visible
    (`4<|im_start|>2`, not `42`); a final control token is the stop token and is left out."""

    tokenizer: Any
    control_ids: frozenset[int]

    @classmethod
    def of(cls, tokenizer: Any) -> ResponseDecoder:
        return cls(tokenizer, frozenset(control_tokens(tokenizer).values()))

    def body(self, ids: list[int]) -> list[int]:
        """`ids` without a final stop (control) token."""
        return list(ids[:-1]) if ids and ids[-1] in self.control_ids else list(ids)

    def __call__(self, ids: list[int]) -> str:
        return self.tokenizer.decode(self.body(ids), skip_special_tokens=False)

    def conversation(self, prompt_ids: list[int], response_ids: list[int]) -> str:
        """The prompt and the response as the policy saw them, every token kept (the chat template's
        rendering and the stop token): what a reward model scores."""
        return self.tokenizer.decode(list(prompt_ids) + list(response_ids), skip_special_tokens=False)

    def num_control(self, ids: list[int]) -> int:
        """Control tokens inside the response (the final stop token not counted)."""
        return sum(i in self.control_ids for i in self.body(ids))
