"""Shared helpers of the rollout-engine tests: tiny random HF checkpoints and reference computations."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

sys.path.insert(0, str(Path(__file__).parents[2] / "models"))
# randomize_: weights with O(1) logits (greedy far from ties); run_in_triton_interpreter: re-exported.
from models_testutil import randomize_, run_in_triton_interpreter  # noqa: E402, F401

VOCAB = 128


def tiny_dense(seed: int = 0, layers: int = 2) -> Qwen3ForCausalLM:
    cfg = Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
        eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    return randomize_(Qwen3ForCausalLM(cfg), seed).eval()


def tiny_moe(seed: int = 0) -> Qwen3MoeForCausalLM:
    cfg = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=512, norm_topk_prob=True, eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    return randomize_(Qwen3MoeForCausalLM(cfg), seed).eval()


def tiny_deepseek(seed: int = 0, *, q_lora_rank: int | None = 16) -> DeepseekV3ForCausalLM:
    """DeepSeek-V3 shape in miniature: MLA (with or without query LoRA), sigmoid group-limited routing."""
    cfg = DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        first_k_dense_replace=0, num_attention_heads=4, q_lora_rank=q_lora_rank, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2,
        n_group=2, topk_group=1, n_shared_experts=1, max_position_embeddings=512, eos_token_id=None,
        bos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    return randomize_(DeepseekV3ForCausalLM(cfg), seed).eval()


def tiny_moe_tied(seed: int = 0) -> Qwen3MoeForCausalLM:
    """Qwen3-MoE with tied embeddings, q/k/v/o biases, one KV head (replicated at tp 2) and a
    vocabulary of 100 (rows padded at tp 2: 52 per rank)."""
    cfg = Qwen3MoeConfig(
        vocab_size=100, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
        max_position_embeddings=512, norm_topk_prob=True, tie_word_embeddings=True, attention_bias=True, eos_token_id=None,
        bos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    return randomize_(Qwen3MoeForCausalLM(cfg), seed).eval()


def tiny_mla(seed: int = 0) -> torch.nn.Module:
    """DeepSeek-V3 (MLA with query LoRA, a dense first layer, shared experts, group routing)."""
    cfg = DeepseekV3Config(
        vocab_size=128, hidden_size=64, num_attention_heads=4, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, first_k_dense_replace=1, num_key_value_heads=4, n_routed_experts=8,
        n_shared_experts=1, n_group=4, topk_group=2, num_experts_per_tok=2, q_lora_rank=24, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12, max_position_embeddings=512,
        eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    return randomize_(AutoModelForCausalLM.from_config(cfg), seed).eval()


def save(hf_model: torch.nn.Module, folder: Path) -> str:
    hf_model.save_pretrained(folder)
    return str(folder)


def prompts(num: int, *, max_len: int = 20, seed: int = 0) -> list[list[int]]:
    """`num` random prompts of mixed lengths 1..max_len."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len + 1, (num,), generator=gen).tolist()
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


@torch.no_grad()
def hf_greedy(hf_model: torch.nn.Module, batch: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy generate of every prompt, left-padded into one batch."""
    width = max(len(p) for p in batch)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    out = hf_model.generate(
        ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens, pad_token_id=0, eos_token_id=None,
    )  # fmt: skip
    return out[:, width:].tolist()


@torch.no_grad()
def full_forward_logprobs(
    model: torch.nn.Module, prompt: list[int], tokens: list[int], temperature: float
) -> list[float]:
    """log_softmax(logits / T) of each generated token from one full forward of the native model."""
    ids = torch.tensor([prompt + tokens])
    logits = model(ids)[0, len(prompt) - 1 : -1].float()
    t = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits / t, dim=-1).gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()
