"""Qwen2.5-VL: a Qwen2 decoder (q/k/v biases) with M-RoPE positions, and a vision tower whose merged
patch features take the place of the prompt's image placeholder tokens (rlloom/models/vision.py).

config.json comes in two shapes: the Hub's (the decoder's fields at the top level) and the one
transformers 5 writes (under `text_config`); both are read. Tensor names are the Hub's: the decoder
under `model.`, the tower under `visual.` with the native module's own names.
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
from rlloom.models.families.tp_plan import DENSE_MLP_TP, GQA_TP, NORMS_TP

_MODEL_TYPES = ("qwen2_5_vl",)


def qwen2_5_vl_text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The decoder's fields at the top level (transformers 5 nests them under `text_config`)."""
    return {**cfg, **(cfg.get("text_config") or {}), "model_type": cfg["model_type"]}


def vision_args(cfg: dict[str, Any]) -> VisionArgs:
    """The tower's `VisionArgs` from config.json's `vision_config` (ValueError for a variant rlloom lacks)."""
    v = cfg["vision_config"]
    if v.get("hidden_act", "silu") != "silu":
        raise ValueError(
            f"config.json vision_config.hidden_act={v['hidden_act']!r} is not supported (rule: 'silu'). "
            "Fix: use a Qwen2.5-VL checkpoint."
        )
    return VisionArgs(
        **vision_fields(cfg, patch_size=14),
        window_size=v.get("window_size", 112),
        fullatt_block_indexes=tuple(v.get("fullatt_block_indexes") or ()),
    )


def qwen2_5_vl_args(cfg: dict[str, Any]) -> FamilyArgs:
    return FamilyArgs(
        attention_bias=True,
        vision=vision_args(cfg),
        mrope_section=mrope_section(cfg, default=None, family="Qwen2.5-VL"),
    )


QWEN2_5_VL = Family(
    model_types=_MODEL_TYPES,
    args=qwen2_5_vl_args,
    names=WeightNames(NORMS | GQA | DENSE_MLP),
    tp=NORMS_TP | GQA_TP | DENSE_MLP_TP,  # the decoder's (a vision model runs at tp=1 today: preflight)
    text_config=qwen2_5_vl_text_config,
    tower_prefix="visual.",
)
