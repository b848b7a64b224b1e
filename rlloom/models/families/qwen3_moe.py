"""Qwen3-MoE: Qwen3's attention (QK-norm), softmax-routed experts on every `decoder_sparse_step`-th
layer except `mlp_only_layers` (those keep the dense MLP)."""

from __future__ import annotations

from typing import Any

from rlloom.models.arg_parts import MoEArgs
from rlloom.models.families.base import (
    DENSE_MLP,
    GQA,
    NORMS,
    QWEN_EXPERTS,
    QWEN_MOE,
    Family,
    FamilyArgs,
    WeightNames,
)
from rlloom.models.families.tp_plan import DENSE_MLP_TP, GQA_TP, MOE_TP, NORMS_TP, QK_NORM_TP


def qwen3_moe_args(cfg: dict[str, Any]) -> FamilyArgs:
    step = cfg.get("decoder_sparse_step", 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    sparse = tuple(i for i in range(cfg["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0)
    moe = MoEArgs(
        num_experts=cfg.get("num_experts") or cfg["num_local_experts"],
        top_k=cfg["num_experts_per_tok"],
        intermediate_size=cfg["moe_intermediate_size"],
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        sparse_layers=sparse,
    )
    bias = bool(cfg.get("attention_bias", False))
    return FamilyArgs(attention_bias=bias, attention_out_bias=bias, qk_norm=True, moe=moe)


QWEN3_MOE = Family(
    model_types=("qwen3_moe",),
    args=qwen3_moe_args,
    names=WeightNames(NORMS | GQA | DENSE_MLP | QWEN_MOE, QWEN_EXPERTS),
    tp=NORMS_TP | GQA_TP | QK_NORM_TP | DENSE_MLP_TP | MOE_TP,
)
