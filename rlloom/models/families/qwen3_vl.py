"""Qwen3-VL: a Qwen3 decoder (QK-norm) with interleaved M-RoPE, and a vision tower with learned
position embeddings and DeepStack (rlloom/models/vision_qwen3.py).

config.json nests the decoder's fields under `text_config` (transformers 5 and the Hub alike). The
checkpoint's names are transformers': the decoder under `model.language_model.`, the tower under
`model.visual.` (natively `visual.`, the names after the prefix the same), the head `lm_head`.
"""

from __future__ import annotations

from typing import Any

from rlloom.models.arg_parts import VisionArgs
from rlloom.models.families.base import (
    DENSE_MLP,
    GQA,
    NORMS,
    Family,
    FamilyArgs,
    WeightNames,
    mrope_section,
    vision_fields,
)
from rlloom.models.families.tp_plan import DENSE_MLP_TP, GQA_TP, NORMS_TP, QK_NORM_TP


def qwen3_vl_text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The decoder's fields at the top level; `tie_word_embeddings` is the top level's, as transformers
    reads it for the whole model."""
    text = cfg.get("text_config") or {}
    tied = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    return {**cfg, **text, "model_type": cfg["model_type"], "tie_word_embeddings": tied}


def vision_args(cfg: dict[str, Any]) -> VisionArgs:
    """The tower's `VisionArgs` from config.json's `vision_config` (ValueError for a variant rlloom lacks)."""
    v = cfg["vision_config"]
    act = v.get("hidden_act", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ValueError(
            f"config.json vision_config.hidden_act={act!r} is not supported (rule: 'gelu_pytorch_tanh'). "
            "Fix: use a Qwen3-VL checkpoint."
        )
    return VisionArgs(
        **vision_fields(cfg, patch_size=16),
        num_position_embeddings=v.get("num_position_embeddings", 2304),
        deepstack_visual_indexes=tuple(v.get("deepstack_visual_indexes", (8, 16, 24))),
    )


def qwen3_vl_args(cfg: dict[str, Any]) -> FamilyArgs:
    bias = bool(cfg.get("attention_bias", False))
    return FamilyArgs(
        attention_bias=bias,
        attention_out_bias=bias,
        qk_norm=True,
        vision=vision_args(cfg),
        mrope_section=mrope_section(cfg, default=[24, 20, 20], family="Qwen3-VL"),
        mrope_interleaved=True,  # transformers' Qwen3-VL always interleaves (whatever `mrope_interleaved` says)
    )


QWEN3_VL = Family(
    model_types=("qwen3_vl",),
    args=qwen3_vl_args,
    names=WeightNames(NORMS | GQA | DENSE_MLP),
    tp=NORMS_TP
    | GQA_TP
    | QK_NORM_TP
    | DENSE_MLP_TP,  # the decoder's (a vision model runs at tp=1: preflight)
    text_config=qwen3_vl_text_config,
    decoder_prefix="model.language_model.",
    tower_prefix="model.visual.",
)
