"""Token ids of new chat messages appended to a conversation, as the chat template renders them.

The conversation is re-rendered with the new messages (and the generation prompt), and the ids of
the text after the tokens so far are the new tokens: when the rendering does not start with the
tokens so far (decoded with their special tokens), the template does not extend them and the caller
starts a new segment from the whole rendering instead.

Messages are data: a control-token string inside an observation (a tool's output, a user's text) is
encoded as plain text, never as the template's structure (`rlloom.data.control_tokens`), as the
prompts are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlloom.data.control_tokens import END, START, control_pattern, control_tokens, encode_chat, mark
from rlloom.episodes.types import Message


@dataclass(frozen=True, slots=True)
class Rendered:
    """A conversation rendered from marked messages (control-token strings of the data marked)."""

    marked: str

    @property
    def text(self) -> str:
        """What the model reads."""
        return self.marked.replace(START, "").replace(END, "")


def render_conversation(
    tokenizer: Any,
    messages: list[Message],
    *,
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool = True,
) -> Rendered:
    """The whole conversation as the model sees it, ending with the assistant's generation prompt
    (without it: ending with the last message's turn, as `rlloom sft` renders an assistant's answer)."""
    kwargs = {"tools": tools} if tools else {}
    marked = mark(messages, control_pattern(control_tokens(tokenizer)))
    return Rendered(
        tokenizer.apply_chat_template(
            marked, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
        )
    )


def encode(tokenizer: Any, rendered: Rendered) -> list[int]:
    """The rendering's ids: the template's own control tokens special, the data's as plain text."""
    return encode_chat(tokenizer, rendered.marked, control_tokens(tokenizer))


def extension_ids(tokenizer: Any, so_far_ids: list[int], rendered: Rendered) -> list[int] | None:
    """The ids of `rendered` after the text of `so_far_ids`, or None when `rendered` does not start
    with that text (the template rewrote earlier turns)."""
    so_far = tokenizer.decode(so_far_ids, skip_special_tokens=False)
    if not rendered.text.startswith(so_far):
        return None
    return encode(tokenizer, Rendered(_after(rendered.marked, len(so_far))))


def _after(marked: str, num_chars: int) -> str:
    """`marked` after its first `num_chars` characters of text (markers do not count); a marker
    pair cut open at the boundary is closed again so the piece stays plain text."""
    seen, i, opened = 0, 0, False
    while seen < num_chars:
        ch = marked[i]
        if ch == START:
            opened = True
        elif ch == END:
            opened = False
        else:
            seen += 1
        i += 1
    rest = marked[i:]
    return START + rest if opened else rest
