"""Tiny random test models: `rlloom init-model tiny-dense|tiny-moe|tiny-mla|tiny-vl|tiny-vl3 DIR`.

Each is a Hugging Face folder saved by transformers (a Qwen3, a Qwen3-MoE with 8 experts of which 2
per token, a DeepSeek-V3 with MLA attention, one dense layer and then MoE layers with a shared
expert and grouped routing, a Qwen2.5-VL with a two-block vision tower, or a Qwen3-VL with a
two-block tower whose first block feeds DeepStack; the VL models with their image processor's
preprocessor_config.json and the vision tokens in their vocabulary), a few hundred kilobytes of random weights with a character-level fast
tokenizer (every printable character a token, a chat template, `<|im_end|>` as end of turn). They
learn nothing useful; they are for trying settings and parallel layouts on a CPU in seconds. The
tests build their fixtures with the same function (tests/conftest.py).
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Literal

from rlloom.config import ConfigError

TinyKind = Literal["tiny-dense", "tiny-moe", "tiny-mla", "tiny-vl", "tiny-vl3"]
TINY_KINDS: tuple[str, ...] = ("tiny-dense", "tiny-moe", "tiny-mla", "tiny-vl", "tiny-vl3")
VL_KINDS = ("tiny-vl", "tiny-vl3")
SPECIAL = ["<pad>", "<|im_start|>", "<|im_end|>"]
VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
"""Qwen2.5-VL's and Qwen3-VL's: an image is <|vision_start|>, one <|image_pad|> per merged patch,
<|vision_end|>."""
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VL_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}{% if part['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Qwen2.5-VL's way with image parts: each writes one placeholder, which the prompt's tokenization
expands to the image's run of tokens (`rlloom.data.images.expand_image_tokens`)."""


def char_tokenizer(  # noqa: ANN201 (transformers' PreTrainedTokenizerFast, lazily)
    *, vision: bool = False, vocab_size: int = 0
):
    """A fast tokenizer with one token per printable character, a chat template and an end-of-turn
    token (`vision`: and Qwen2.5-VL's three vision tokens, at the end of the vocabulary).
    `vocab_size`: filled up to this many tokens with plain words `<fill_N>` that no text encodes to,
    for a random model of a real vocabulary's width (Qwen3's 151936), every id of which then decodes."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(string.printable) - set("\x0b\x0c\r"))
    tail = VISION_TOKENS if vision else []
    fill = [f"<fill_{i}>" for i in range(vocab_size - len(SPECIAL) - len(chars) - len(tail))]
    vocab = {tok: i for i, tok in enumerate(SPECIAL + chars + fill + tail)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<|im_end|>", bos_token=None, unk_token="<pad>"
    )
    tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<|im_start|>"] + (VISION_TOKENS if vision else [])}
    )
    tokenizer.chat_template = VL_CHAT_TEMPLATE if vision else CHAT_TEMPLATE
    return tokenizer


def tiny_config(kind: TinyKind, *, vocab_size: int, eos: int, pad: int, hidden: int, layers: int):  # noqa: ANN201
    """The transformers config of a tiny model of `kind` (4 attention heads, 2 KV heads for GQA)."""
    from transformers import DeepseekV3Config, Qwen3Config, Qwen3MoeConfig

    if kind in VL_KINDS:
        return tiny_vl_config(kind, vocab_size=vocab_size, eos=eos, pad=pad, hidden=hidden, layers=layers)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=eos,
        pad_token_id=pad,
        bos_token_id=None,
    )
    if kind == "tiny-mla":
        return DeepseekV3Config(
            **common,
            num_key_value_heads=4,
            moe_intermediate_size=hidden // 2,
            first_k_dense_replace=1,
            n_routed_experts=8,
            n_shared_experts=1,
            n_group=4,
            topk_group=2,
            num_experts_per_tok=2,
            q_lora_rank=24,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=12,
        )
    gqa = dict(num_key_value_heads=2, head_dim=hidden // 4)
    if kind == "tiny-moe":
        moe = dict(moe_intermediate_size=hidden, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
        return Qwen3MoeConfig(**moe, **gqa, **common)
    return Qwen3Config(**gqa, **common)


def tiny_vl_config(kind: TinyKind, *, vocab_size: int, eos: int, pad: int, hidden: int, layers: int):  # noqa: ANN201
    """A Qwen2.5-VL (tiny-vl): the decoder as the other tiny models (M-RoPE over its hidden / 8
    frequency pairs), a two-block tower of width 32 with 56-pixel windows in its first block; or a
    Qwen3-VL (tiny-vl3): a Qwen3 decoder (interleaved M-RoPE), a two-block tower of width 32 with
    16-pixel patches, a 4 x 4 learned position table and DeepStack from its first block. The vision
    tokens are the vocabulary's last three."""
    from transformers import Qwen2_5_VLConfig, Qwen3VLConfig

    pairs = hidden // 8
    spatial = pairs // 4
    text = dict(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, eos_token_id=eos,
        pad_token_id=pad, bos_token_id=None, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "mrope_section": [pairs - 2 * spatial, spatial, spatial]},
    )  # fmt: skip
    vision = dict(
        depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=hidden, window_size=56,
        fullatt_block_indexes=[1],
    )  # fmt: skip
    start, image, end = range(vocab_size - 3, vocab_size)
    if kind == "tiny-vl3":
        vision = dict(
            depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=hidden, patch_size=16,
            num_position_embeddings=16, deepstack_visual_indexes=[0],
        )  # fmt: skip
        return Qwen3VLConfig(
            text_config=text | {"head_dim": hidden // 4}, vision_config=vision, image_token_id=image,
            video_token_id=pad, vision_start_token_id=start, vision_end_token_id=end, tie_word_embeddings=True,
        )  # fmt: skip
    return Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=image, video_token_id=pad,
        vision_start_token_id=start, vision_end_token_id=end, tie_word_embeddings=True,
    )  # fmt: skip


def write_tiny_model(
    kind: str, path: str | Path, *, seed: int = 0, hidden: int = 32, layers: int = 2
) -> Path:
    """Write a tiny random model of `kind` (TINY_KINDS) with the character tokenizer into `path`."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLImageProcessorPil,
        Qwen3VLForConditionalGeneration,
    )

    if kind not in TINY_KINDS:
        raise ConfigError(f"model kind {kind!r} is unknown. Fix: use one of {', '.join(TINY_KINDS)}.")
    if hidden < 16 or hidden % 8 or layers < 1:
        raise ConfigError(
            f"--hidden {hidden} --layers {layers} is invalid: hidden must be a multiple of 8 and >= 16 (4 heads), "
            "layers >= 1. Fix: e.g. --hidden 32 --layers 4."
        )
    tokenizer = char_tokenizer(vision=kind in VL_KINDS)
    vocab = tokenizer.get_vocab()
    config = tiny_config(
        kind, vocab_size=len(vocab), eos=vocab["<|im_end|>"], pad=vocab["<pad>"], hidden=hidden, layers=layers
    )
    torch.manual_seed(seed)
    if kind == "tiny-vl":
        model = Qwen2_5_VLForConditionalGeneration(config)
    elif kind == "tiny-vl3":
        model = Qwen3VLForConditionalGeneration(config)
    else:
        model = AutoModelForCausalLM.from_config(config)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if kind in VL_KINDS:  # small pictures stay small: at most 8 x 8 patches (16 image tokens)
        patch = 14 if kind == "tiny-vl" else 16
        side = 2 * patch * 4
        Qwen2VLImageProcessorPil(
            patch_size=patch, size={"shortest_edge": (2 * patch) ** 2, "longest_edge": side * side}
        ).save_pretrained(out)
    return out
