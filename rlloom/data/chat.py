"""Chat templating and tokenization of prompts, done once up front.

With `chat_template=True` a prompt (a user string, or a list of chat messages) goes through the
tokenizer's own template with the generation prompt added, and the resulting text is encoded
WITHOUT adding special tokens again (the template already wrote them). With
`chat_template=False` the prompt string is encoded as it is, with the tokenizer's usual special
tokens (e.g. a BOS token for Llama-style tokenizers). Either way a control-token string inside the
data (prompt, messages, data.system_prompt) is encoded as plain text, never as the control token
(`rlloom.data.control_tokens`): only the template writes the chat's structure.

Any object with `encode(text, add_special_tokens=..., split_special_tokens=...)` and
`apply_chat_template(messages, add_generation_prompt=True, tokenize=False)` works as a tokenizer:
Hugging Face tokenizers do, and so do the small fakes used in tests (`added_tokens_decoder`, the
special tokens, is read when present).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from rlloom.data.control_tokens import (
    control_pattern,
    control_tokens,
    encode_chat,
    encode_raw,
    mark,
    unmarked,
)
from rlloom.data.dataset import DataError, Message, PromptItem, RawPrompt
from rlloom.data.images import ImageInputs, ImageProcessing

logger = logging.getLogger(__name__)


class PromptTokenizer(Protocol):
    """The part of a (Hugging Face) tokenizer that prompt preparation uses."""

    def encode(
        self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False
    ) -> list[int]: ...

    def apply_chat_template(
        self, conversation: list[Message], *, add_generation_prompt: bool, tokenize: bool
    ) -> Any: ...


@dataclass(kw_only=True, slots=True)
class TokenizedPrompts:
    """The prompts that fit, and how many were skipped for length."""

    items: list[PromptItem]
    num_too_long: int
    """Prompts longer than max_prompt_length tokens, skipped."""


def prompt_messages(prompt: str | list[Message], system_prompt: str = "") -> list[Message]:
    """The chat messages of a prompt: a string becomes one user message; `system_prompt` goes first
    unless the prompt already starts with its own system message (which then wins)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def encode_prompt(
    prompt: str | list[Message],
    tokenizer: PromptTokenizer,
    *,
    chat_template: bool,
    system_prompt: str = "",
    tokens: dict[str, int] | None = None,
) -> tuple[str, list[int]]:
    """(the text the model sees for this prompt, its ids): the chat template's output, or the raw
    string. `tokens`: the tokenizer's control tokens (`control_tokens`), found once by the caller."""
    tokens = control_tokens(tokenizer) if tokens is None else tokens
    if chat_template:
        if getattr(tokenizer, "chat_template", "") is None:
            raise DataError(
                "data.chat_template=True but the tokenizer has no chat template; "
                "fix: set data.chat_template=false to encode raw prompt text, or use an instruct tokenizer"
            )
        messages = mark(prompt_messages(prompt, system_prompt), control_pattern(tokens))
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return unmarked(rendered), encode_chat(tokenizer, rendered, tokens)
    if not isinstance(prompt, str):
        raise DataError(
            "data.chat_template=False but a prompt is a list of chat messages, which has no raw-text form; "
            "fix: set data.chat_template=true or store prompts as strings"
        )
    return prompt, encode_raw(tokenizer, prompt)


def tokenize_prompts(
    prompts: Sequence[RawPrompt],
    tokenizer: PromptTokenizer,
    *,
    chat_template: bool,
    system_prompt: str = "",
    max_prompt_length: int,
    images: ImageProcessing | None = None,
) -> TokenizedPrompts:
    """Template and encode every prompt; those over `max_prompt_length` tokens are skipped and counted.
    A prompt with pictures needs `images` (a vision-language model's): they are read and processed,
    and each placeholder the template writes becomes its image's run of tokens (`with_images`).

    Raises DataError when prompts were given and none fits.
    """
    if system_prompt and not chat_template:
        logger.warning("data.system_prompt is set but data.chat_template=False, so it is not used")
    items: list[PromptItem] = []
    too_long: list[int] = []
    tokens = control_tokens(tokenizer)
    for raw in prompts:
        prompt = raw.prompt if not raw.images else with_image_parts(raw)
        text, ids = encode_prompt(
            prompt, tokenizer, chat_template=chat_template, system_prompt=system_prompt, tokens=tokens
        )
        pixels = None
        if raw.images:
            ids, pixels = prompt_images(raw, ids, images)
        if len(ids) > max_prompt_length:
            too_long.append(len(ids))
            continue
        items.append(
            PromptItem(
                prompt_ids=ids,
                prompt_text=text,
                ground_truth=raw.ground_truth,
                index=raw.index,
                metadata=dict(raw.metadata),
                prompt=raw.prompt,
                images=pixels,
            )
        )
    if too_long and not items:
        raise DataError(
            f"data.max_prompt_length={max_prompt_length}: all {len(too_long)} prompts are longer "
            f"(shortest {min(too_long)} tokens); fix: raise data.max_prompt_length to at least {min(too_long)}"
        )
    if too_long:
        logger.warning(
            "skipped %d of %d prompts longer than data.max_prompt_length=%d tokens (longest %d)",
            len(too_long),
            len(prompts),
            max_prompt_length,
            max(too_long),
        )
    return TokenizedPrompts(items=items, num_too_long=len(too_long))


def with_image_parts(raw: RawPrompt) -> list[Message]:
    """A prompt with pictures as chat messages with image parts: as the row holds them, or (an
    `images` column) one image part per picture opening the first user message, so the template
    writes their placeholders before its text."""
    if isinstance(raw.prompt, list) and any(
        isinstance(m.get("content"), list) and any(p.get("type") == "image" for p in m["content"])
        for m in raw.prompt
    ):
        return raw.prompt
    messages = prompt_messages(raw.prompt)
    first = next(i for i, m in enumerate(messages) if m["role"] == "user")
    content = messages[first]["content"]
    text = content if isinstance(content, list) else [{"type": "text", "text": content}]
    parts = [{"type": "image", "image": path} for path in raw.images]
    messages[first] = {**messages[first], "content": parts + text}
    return messages


def prompt_images(
    raw: RawPrompt, ids: list[int], images: ImageProcessing | None
) -> tuple[list[int], ImageInputs]:
    """The prompt's ids with its image placeholders expanded, and its processed pictures."""
    if images is None:
        raise DataError(
            f"prompt {raw.index} has images but the model reads no pictures (no image processor); fix: "
            "use a vision-language model folder with its preprocessor_config.json, or rows without images"
        )
    try:
        return images.prompt(ids, raw.images)
    except ValueError as err:
        raise DataError(
            f"prompt {raw.index}: {err} after the chat template; fix: set data.chat_template=true with a "
            "template that writes one image placeholder per image part (as Qwen2.5-VL's does)"
        ) from err
