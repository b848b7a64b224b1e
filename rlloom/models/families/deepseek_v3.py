"""DeepSeek-V3: multi-head latent attention (MLA; interleaved RoPE unless `rope_interleave` is false),
sigmoid group-limited routing with a score-correction bias and shared experts after the first
`first_k_dense_replace` dense layers; its checkpoints' multi-token-prediction layers are skipped."""

from __future__ import annotations

from typing import Any

from rlloom.models.arg_parts import MLAArgs, MoEArgs
from rlloom.models.families.base import (
    DENSE_MLP,
    NORMS,
    QWEN_EXPERTS,
    QWEN_MOE,
    Family,
    FamilyArgs,
    WeightNames,
)
from rlloom.models.families.tp_plan import COLUMN, DENSE_MLP_TP, MOE_TP, NORMS_TP, ROW, LayerPlan, Split

MLA = {
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.q_a_proj.weight": "attention.wq_a.weight",
    "self_attn.q_a_proj.bias": "attention.wq_a.bias",
    "self_attn.q_a_layernorm.weight": "attention.q_norm.weight",
    "self_attn.q_b_proj.weight": "attention.wq_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attention.wkv_a.weight",
    "self_attn.kv_a_proj_with_mqa.bias": "attention.wkv_a.bias",
    "self_attn.kv_a_layernorm.weight": "attention.kv_norm.weight",
    "self_attn.kv_b_proj.weight": "attention.wkv_b.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "self_attn.o_proj.bias": "attention.wo.bias",
}
"""MLA's Hugging Face names (the attention block of this family)."""
MLA_TP: LayerPlan = {
    "attention.wq": COLUMN,  # without q-LoRA; with it, q_a and its norm are replicated, q_b split
    "attention.wq_a": Split.REPLICATED,
    "attention.q_norm": Split.REPLICATED,
    "attention.wq_b": COLUMN,
    "attention.wkv_a": Split.SHARED_KEY,  # the latent and the rope key k_pe, shared by every head
    "attention.kv_norm": Split.REPLICATED,
    "attention.wkv_b": COLUMN,  # k_nope and v of each head (the training form: expanded per head)
    "attention.wo": ROW,
}
"""MLA's tensor-parallel plan: by heads where a projection is per head, replicated where it is low rank."""


def deepseek_v3_args(cfg: dict[str, Any]) -> FamilyArgs:
    if cfg.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ValueError(
            f"config.json topk_method={cfg['topk_method']!r} is not supported (rule: 'noaux_tc'). "
            "Fix: use a DeepSeek-V3 style checkpoint."
        )
    moe = MoEArgs(
        num_experts=cfg["n_routed_experts"],
        top_k=cfg["num_experts_per_tok"],
        intermediate_size=cfg["moe_intermediate_size"],
        score_func="sigmoid",
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        num_groups=cfg.get("n_group") or 1,
        topk_groups=cfg.get("topk_group") or 1,
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        score_bias=True,
        num_shared_experts=cfg.get("n_shared_experts") or 0,
        sparse_layers=tuple(range(cfg.get("first_k_dense_replace", 0), cfg["num_hidden_layers"])),
    )
    mla = MLAArgs(
        q_lora_rank=cfg.get("q_lora_rank"),
        kv_lora_rank=cfg["kv_lora_rank"],
        qk_nope_head_dim=cfg["qk_nope_head_dim"],
        qk_rope_head_dim=cfg["qk_rope_head_dim"],
        v_head_dim=cfg["v_head_dim"],
    )
    bias = bool(cfg.get("attention_bias", False))
    return FamilyArgs(
        attention_bias=bias,
        attention_out_bias=bias,
        moe=moe,
        mla=mla,
        rope_interleaved=bool(cfg.get("rope_interleave", True)),
    )


DEEPSEEK_V3 = Family(
    model_types=("deepseek_v3",),
    args=deepseek_v3_args,
    names=WeightNames(NORMS | MLA | DENSE_MLP | QWEN_MOE, QWEN_EXPERTS),
    tp=NORMS_TP | MLA_TP | DENSE_MLP_TP | MOE_TP,
    mtp_layers=True,
)
