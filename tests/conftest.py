"""Shared fixtures: a tiny random Hugging Face checkpoint with a character-level tokenizer.

Small enough to build in well under a second, real enough for the whole RL loop: a Qwen3 model
saved by transformers, and a fast tokenizer with a chat template and an end-of-turn token.
"""

from __future__ import annotations

import string
from pathlib import Path

import pytest
import torch

SPECIAL = ["<pad>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_checkpoint(
    path: Path, *, seed: int = 0, hidden: int = 32, layers: int = 2, moe: bool = False
) -> Path:
    """Write a tiny Qwen3 (or, with `moe`, Qwen3-MoE: 8 experts, 2 per token) checkpoint with a
    character tokenizer into `path` and return it."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

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
    moe_fields = dict(moe_intermediate_size=hidden, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
    config = (Qwen3MoeConfig if moe else Qwen3Config)(
        **(moe_fields if moe else {}),
        vocab_size=len(vocab),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=vocab["<|im_end|>"],
        pad_token_id=vocab["<pad>"],
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = (Qwen3MoeForCausalLM if moe else Qwen3ForCausalLM)(config)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


@pytest.fixture(scope="session")
def tiny_moe_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_moe") / "ckpt", moe=True)


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray instance for every Ray test of the session (each start costs 5-10 s of CPU on
    two cores, and five modules need one). Five CPUs: the largest layout (4 training + 1 rollout
    slots); a run joins it instead of starting its own. The Ray tests run last (see below), so the
    instance does not idle beside the rest of the suite."""
    ray = pytest.importorskip("ray", reason="needs the ray extra: pip install 'rlloom[ray]'")
    ray.init(num_cpus=5, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests that use `ray_cluster` run after all others (in their collected order), so one Ray
    start serves them all and is shut down when they end."""
    items.sort(key=lambda item: "ray_cluster" in getattr(item, "fixturenames", ()))
