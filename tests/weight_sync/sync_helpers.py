"""Tiny training and rollout sides for weight-sync tests: a native model whose optimizer steps at a
large learning rate (so every sync carries new values) as the source, and a native rollout engine
(fused projections, as in a run) or a tensor-parallel stand-in as the sink."""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
from transformers import DeepseekV3Config, Qwen3Config, Qwen3MoeConfig

from rlloom.engines.rollout.native import NativeEngine
from rlloom.engines.train.native.weights import named_weight_buckets
from rlloom.models import hf_named_tensors
from rlloom.models.checkpoint import build_model

VOCAB = 64
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, max_position_embeddings=128)


def hf_config(kind: str) -> dict:
    """A tiny Hugging Face config: dense Qwen3 with tied embeddings, Qwen3-MoE, or DeepSeek-V3 (MLA
    with q-LoRA, shared and routed experts)."""
    if kind == "dense":
        cfg = Qwen3Config(
            **_COMMON, intermediate_size=64, num_hidden_layers=2, num_key_value_heads=2, head_dim=8
        )
        cfg.tie_word_embeddings = True
    elif kind == "moe":
        cfg = Qwen3MoeConfig(
            **_COMMON,
            intermediate_size=64,
            moe_intermediate_size=16,
            num_hidden_layers=2,
            num_key_value_heads=2,
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
        )
    else:
        cfg = DeepseekV3Config(
            **_COMMON,
            intermediate_size=64,
            moe_intermediate_size=16,
            num_hidden_layers=2,
            first_k_dense_replace=1,
            num_key_value_heads=4,
            n_routed_experts=4,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            num_experts_per_tok=2,
            q_lora_rank=24,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=12,
        )
    return cfg.to_dict()


class TrainSide:
    """The weight source: a native model in fp32 with an optimizer that steps; deterministic from
    `seed` (its own generator), so another process can replay it to know the expected weights."""

    def __init__(self, kind: str, *, seed: int = 0) -> None:
        self.rng = torch.Generator().manual_seed(seed)
        self.model = build_model(hf_config(kind), dtype=torch.float32, device="cpu")
        with torch.no_grad():
            for tensor in self.model.state_dict().values():  # parameters and persistent buffers
                tensor.copy_(0.05 * torch.randn(tensor.shape, generator=self.rng))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=3e-2)
        self.version = 0
        self.skip: set[str] = set()
        """Names left out of `named_weights` (to test a missing tensor)."""

    def step(self) -> None:
        """One optimizer step (SGD, lr 3e-2) on a random gradient for every parameter: every tensor
        changes by about 3e-2 per step, so a stale or skipped tensor cannot go unnoticed."""
        for p in self.model.parameters():
            p.grad = torch.randn(p.shape, generator=self.rng)
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.version += 1

    def named_weights(
        self,
        *,
        bucket_bytes: int,
        dtype: torch.dtype | None = None,
        owned_only: bool = False,
        lazy_cast: bool = False,
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        buckets = named_weight_buckets(
            self.model, bucket_bytes=bucket_bytes, dtype=dtype, lazy_cast=lazy_cast
        )
        for bucket in buckets:
            yield [(n, t) for n, t in bucket if n not in self.skip]

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: t.clone() for b in named_weight_buckets(self.model, bucket_bytes=1 << 30) for n, t in b}


def rollout_engine(
    kind: str, tp_group: object = None, dtype: torch.dtype = torch.float32, quantization: str = "none"
) -> NativeEngine:
    """A native rollout engine (fused q/k/v and gate/up) with zero weights until the first sync; with
    `tp_group`, this rank of a tensor-parallel one."""
    model = build_model(hf_config(kind), dtype=dtype, device="cpu", fused_projections=True)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    tp = {} if tp_group is None else {"tp_group": tp_group}
    return NativeEngine(
        model,
        max_model_len=64,
        num_blocks=8,
        block_size=16,
        max_num_seqs=4,
        compile=False,
        quantization=quantization,
        **tp,
    )


def rollout_weights(engine: NativeEngine) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in hf_named_tensors(engine.model)}


def shard_dims(names: list[str]) -> dict[str, int | None]:
    """A rollout TP layout as the engine would declare it: column-parallel q/k/v, gate/up and the
    vocabulary (embedding, head) on dim 0, row-parallel o/down on dim 1, everything else whole."""
    dims: dict[str, int | None] = {}
    for name in names:
        if any(
            k in name
            for k in ("q_proj.", "k_proj.", "v_proj.", "gate_proj.", "up_proj.", "embed_tokens", "lm_head")
        ):
            dims[name] = 0
        elif any(k in name for k in ("o_proj.", "down_proj.")):
            dims[name] = 1
    return dims


class ShardSink:
    """A rollout TP rank's stand-in: keeps what it is given, as a TP engine keeps its slices."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.policy_version = 0

    def update_weights(self, named_tensors, version: int) -> None:
        for name, tensor in named_tensors:
            self.tensors[name] = tensor.clone()
        self.policy_version = version


EXPERT = re.compile(r"\.experts\.(\d+)\.")
"""The expert index in a Hugging Face name (`model.layers.0.mlp.experts.3.up_proj.weight`)."""


def expert_of(name: str) -> int | None:
    m = EXPERT.search(name)
    return None if m is None else int(m.group(1))
