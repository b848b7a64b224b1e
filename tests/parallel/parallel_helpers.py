"""Helpers of the parallelism tests: spawn gloo process groups, tiny models of each family, packed inputs."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
from procs import free_port, spawn

from rlloom.models.args import MLAArgs, ModelArgs, MoEArgs, RopeArgs
from rlloom.models.layers import RMSNorm
from rlloom.models.model import CausalLM


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple) -> None:
    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, *args)
        # Every rank's last collective has completed before any rank tears gloo down (a rank that
        # destroyed its group while a peer's transfer was still in flight aborted the peer).
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_gloo(fn: Callable, world: int, *args) -> None:
    """Run `fn(rank, *args)` in `world` processes joined by a gloo group; a failure in any fails the test."""
    spawn(_entry, args=(world, free_port(), fn, args), nprocs=world, join=True)


def tiny_args(family: str) -> ModelArgs:
    """A two-layer model of `family`: qwen3 (tied, QK-norm), qwen2 (q/k/v biases), llama (biases),
    qwen3_moe (layer 1 MoE), mixtral (every layer MoE), deepseek_v3 (MLA with q-LoRA, sigmoid routing, shared expert),
    deepseek_v3_nolora (MLA without q-LoRA)."""
    base = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)
    base |= dict(intermediate_size=48, rms_norm_eps=1e-6, rope=RopeArgs(dim=8, theta=10000.0))
    moe = MoEArgs(num_experts=4, top_k=2, intermediate_size=16, norm_topk_prob=True, sparse_layers=(1,))
    if family == "qwen3":
        return ModelArgs(model_type="qwen3", qk_norm=True, tie_word_embeddings=True, **base)
    if family == "qwen2":
        return ModelArgs(model_type="qwen2", attention_bias=True, **base)
    if family == "llama":
        return ModelArgs(model_type="llama", attention_bias=True, attention_out_bias=True, **base)
    if family == "qwen3_moe":
        return ModelArgs(model_type="qwen3_moe", qk_norm=True, moe=moe, **base)
    if family == "mixtral":  # every layer MoE
        return ModelArgs(model_type="mixtral", moe=dataclasses.replace(moe, sparse_layers=(0, 1)), **base)
    if family.startswith("deepseek_v3"):
        q_lora = None if family.endswith("nolora") else 16
        mla = MLAArgs(
            q_lora_rank=q_lora, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8
        )
        ds_moe = MoEArgs(
            num_experts=4,
            top_k=2,
            intermediate_size=16,
            score_func="sigmoid",
            num_groups=2,
            topk_groups=1,
            routed_scaling_factor=2.5,
            score_bias=True,
            num_shared_experts=1,
            sparse_layers=(1,),
        )
        base |= dict(num_kv_heads=4, head_dim=12, rope=RopeArgs(dim=4, interleaved=True))
        return ModelArgs(model_type="deepseek_v3", attention_bias=True, mla=mla, moe=ds_moe, **base)
    raise ValueError(family)


def tiny_model(family: str, seed: int = 0) -> CausalLM:
    """A randomly initialised fp32 model; norm weights and the router bias are random too, so that a
    wrong gradient of any of them shows."""
    torch.manual_seed(seed)
    model = CausalLM(tiny_args(family))
    with torch.no_grad():
        model.tok_embeddings.weight.normal_(std=0.3)  # logits of a few units, as in a trained model
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.weight.uniform_(0.5, 1.5)
            if getattr(module, "expert_bias", None) is not None:
                module.expert_bias.uniform_(-0.1, 0.1)
    return model


def packed_inputs(lengths: list[int], vocab: int, seed: int = 1) -> dict[str, torch.Tensor]:
    """input_ids [N], position_ids [N], cu_seqlens [S + 1] of sequences of `lengths` tokens."""
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    return {
        "input_ids": torch.randint(0, vocab, (n,), generator=g),
        "position_ids": torch.cat([torch.arange(length) for length in lengths]),
        "cu_seqlens": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32),
    }
