"""Mixtral: GQA attention without biases, softmax-routed experts (renormalised top-k) on every
layer, its own expert names (`block_sparse_moe.experts.N.w1`)."""

from __future__ import annotations

from typing import Any

from rlloom.models.arg_parts import MoEArgs
from rlloom.models.families.base import DENSE_MLP, GQA, NORMS, Family, FamilyArgs, WeightNames
from rlloom.models.families.tp_plan import GQA_TP, MOE_TP, NORMS_TP


def mixtral_args(cfg: dict[str, Any]) -> FamilyArgs:
    moe = MoEArgs(
        num_experts=cfg.get("num_local_experts") or cfg["num_experts"],
        top_k=cfg["num_experts_per_tok"],
        intermediate_size=cfg["intermediate_size"],
        norm_topk_prob=True,  # Mixtral always renormalises the top-k softmax weights.
        sparse_layers=tuple(range(cfg["num_hidden_layers"])),
    )
    return FamilyArgs(moe=moe)


def mixtral_window(cfg: dict[str, Any]) -> bool:
    """Mixtral sets `sliding_window` alone; a window as long as the context is no window."""
    window = cfg.get("sliding_window")
    return window is not None and window < cfg.get("max_position_embeddings", 0)


MIXTRAL = Family(
    model_types=("mixtral",),
    args=mixtral_args,
    names=WeightNames(
        NORMS | GQA | DENSE_MLP | {"block_sparse_moe.gate.weight": "moe.router.gate.weight"},
        ("block_sparse_moe.experts.", {"w1": "w1", "w2": "w2", "w3": "w3"}),
    ),
    tp=NORMS_TP | GQA_TP | MOE_TP,  # every layer is an MoE layer
    sliding_window=mixtral_window,
)
