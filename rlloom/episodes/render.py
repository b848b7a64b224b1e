"""Token ids of new chat messages appended to a conversation, as the chat template renders them.

The conversation is re-rendered with the new messages (and the generation prompt), and the ids of
the text after the tokens so far are the new tokens: when the rendering does not start with the
tokens so far (decoded with their special tokens), the template does not extend them and the caller
starts a new segment from the whole rendering instead.
"""

from __future__ import annotations

from typing import Any

from rlloom.episodes.types import Message


def render_conversation(
    tokenizer: Any, messages: list[Message], *, tools: list[dict[str, Any]] | None
) -> str:
    """The whole conversation as the model sees it, ending with the assistant's generation prompt."""
    kwargs = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)


def encode(tokenizer: Any, text: str) -> list[int]:
    """Template text to ids (the template wrote its special tokens already)."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def extension_ids(tokenizer: Any, so_far_ids: list[int], rendered: str) -> list[int] | None:
    """The ids of `rendered` after the text of `so_far_ids`, or None when `rendered` does not start
    with that text (the template rewrote earlier turns)."""
    so_far = tokenizer.decode(so_far_ids, skip_special_tokens=False)
    if not rendered.startswith(so_far):
        return None
    return encode(tokenizer, rendered[len(so_far) :])
