"""Dense GQA decoders: Llama, Qwen2 (q/k/v biases, never an output bias), Qwen3 (QK-norm)."""

from __future__ import annotations

from typing import Any

from rlloom.models.families.base import DENSE_MLP, GQA, NORMS, Family, FamilyArgs, WeightNames
from rlloom.models.families.tp_plan import DENSE_MLP_TP, GQA_TP, NORMS_TP, QK_NORM_TP


def dense_args(cfg: dict[str, Any]) -> FamilyArgs:
    model_type = cfg["model_type"]
    if model_type == "qwen2":  # Qwen2 always has q/k/v biases, and no o bias
        return FamilyArgs(attention_bias=True, attention_out_bias=False)
    bias = bool(cfg.get("attention_bias", False))
    return FamilyArgs(attention_bias=bias, attention_out_bias=bias, qk_norm=model_type == "qwen3")


DENSE = Family(
    model_types=("llama", "qwen2", "qwen3"),
    args=dense_args,
    names=WeightNames(NORMS | GQA | DENSE_MLP),
    tp=NORMS_TP | GQA_TP | QK_NORM_TP | DENSE_MLP_TP,  # QK-norm: Qwen3
)
