"""Tiny random test models: `rlloom init-model tiny-dense|tiny-moe|tiny-mla DIR`.

Each is a Hugging Face folder saved by transformers (a Qwen3, a Qwen3-MoE with 8 experts of which 2
per token, or a DeepSeek-V3 with MLA attention, one dense layer and then MoE layers with a shared
expert and grouped routing), a few hundred kilobytes of random weights with a character-level fast
tokenizer (every printable character a token, a chat template, `<|im_end|>` as end of turn). They
learn nothing useful; they are for trying settings and parallel layouts on a CPU in seconds. The
tests build their fixtures with the same function (tests/conftest.py).
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Literal

from rlloom.config import ConfigError

TinyKind = Literal["tiny-dense", "tiny-moe", "tiny-mla"]
TINY_KINDS: tuple[str, ...] = ("tiny-dense", "tiny-moe", "tiny-mla")
SPECIAL = ["<pad>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def char_tokenizer():  # noqa: ANN201 (transformers' PreTrainedTokenizerFast, imported lazily)
    """A fast tokenizer with one token per printable character, a chat template and an end-of-turn token."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(string.printable) - set("\x0b\x0c\r"))
    vocab = {tok: i for i, tok in enumerate(SPECIAL + chars)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<|im_end|>", bos_token=None, unk_token="<pad>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_config(kind: TinyKind, *, vocab_size: int, eos: int, pad: int, hidden: int, layers: int):  # noqa: ANN201
    """The transformers config of a tiny model of `kind` (4 attention heads, 2 KV heads for GQA)."""
    from transformers import DeepseekV3Config, Qwen3Config, Qwen3MoeConfig

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


def write_tiny_model(
    kind: str, path: str | Path, *, seed: int = 0, hidden: int = 32, layers: int = 2
) -> Path:
    """Write a tiny random model of `kind` (TINY_KINDS) with the character tokenizer into `path`."""
    import torch
    from transformers import AutoModelForCausalLM

    if kind not in TINY_KINDS:
        raise ConfigError(f"model kind {kind!r} is unknown. Fix: use one of {', '.join(TINY_KINDS)}.")
    if hidden < 16 or hidden % 8 or layers < 1:
        raise ConfigError(
            f"--hidden {hidden} --layers {layers} is invalid: hidden must be a multiple of 8 and >= 16 (4 heads), "
            "layers >= 1. Fix: e.g. --hidden 32 --layers 4."
        )
    tokenizer = char_tokenizer()
    vocab = tokenizer.get_vocab()
    config = tiny_config(
        kind, vocab_size=len(vocab), eos=vocab["<|im_end|>"], pad=vocab["<pad>"], hidden=hidden, layers=layers
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
