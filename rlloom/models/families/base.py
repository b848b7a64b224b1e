"""What a model family declares (`Family`), and the Hugging Face weight names of the building blocks
several families share: decoder-layer norms, GQA attention, the dense SwiGLU MLP, and the Qwen-style
MoE layer (router, score-correction bias, shared experts, one tensor per expert).

Natively the experts of a layer are stacked: `layers.3.moe.experts.w1` [E, I, D]; expert j is row j.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from rlloom.models.arg_parts import MLAArgs, MoEArgs, VisionArgs
from rlloom.models.families.tp_plan import LayerPlan

NORMS = {
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
GQA = {
    f"self_attn.{hf}_proj.{p}": f"attention.w{nat}.{p}"
    for hf, nat in zip("qkvo", "qkvo")
    for p in ("weight", "bias")
} | {
    "self_attn.q_norm.weight": "attention.q_norm.weight",
    "self_attn.k_norm.weight": "attention.k_norm.weight",
}
DENSE_MLP = {
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
}
QWEN_MOE = {
    "mlp.gate.weight": "moe.router.gate.weight",
    "mlp.gate.e_score_correction_bias": "moe.router.expert_bias",
    "mlp.shared_experts.gate_proj.weight": "moe.shared_experts.w1.weight",
    "mlp.shared_experts.down_proj.weight": "moe.shared_experts.w2.weight",
    "mlp.shared_experts.up_proj.weight": "moe.shared_experts.w3.weight",
}
QWEN_EXPERTS = ("mlp.experts.", {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"})
"""(HF prefix of the experts inside a layer, {HF projection name: native stacked parameter})."""


@dataclass(frozen=True, slots=True)
class WeightNames:
    """A family's Hugging Face tensor names inside a decoder layer (`model.layers.N.<name>`)."""

    layer: Mapping[str, str]
    """HF name -> native name, for every tensor but the routed experts'."""
    experts: tuple[str, Mapping[str, str]] | None = None
    """Routed experts, one HF tensor each: (prefix, {HF projection: native stacked parameter})."""


@dataclass(frozen=True, kw_only=True, slots=True)
class FamilyArgs:
    """The `ModelArgs` fields whose reading from config.json differs between families."""

    attention_bias: bool = False
    """Biases on the q/k/v projections (MLA: on q_a, kv_a and o)."""
    attention_out_bias: bool = False
    """Bias on the output projection."""
    qk_norm: bool = False
    moe: MoEArgs | None = None
    mla: MLAArgs | None = None
    rope_interleaved: bool = False
    vision: VisionArgs | None = None
    mrope_section: tuple[int, ...] | None = None
    """M-RoPE (Qwen2.5-VL): rotary frequency pairs driven by the temporal, height and width positions."""
    mrope_interleaved: bool = False
    """Those pairs interleaved (Qwen3-VL) instead of consecutive (`RopeArgs.mrope_interleaved`)."""


def uses_sliding_window(cfg: dict[str, Any]) -> bool:
    """Whether config.json asks for sliding-window attention (`use_sliding_window`)."""
    return bool(cfg.get("use_sliding_window"))


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class Family:
    """One model family: everything rlloom knows about it, its tensor-parallel plan included (training
    and rollout both read `tp`)."""

    model_types: tuple[str, ...]
    """The config.json `model_type`s it reads."""
    args: Callable[[dict[str, Any]], FamilyArgs]
    """Its part of `ModelArgs.from_hf_config`: config.json -> the family-specific fields (ValueError
    for what rlloom does not implement)."""
    names: WeightNames
    tp: LayerPlan
    """How each module of its decoder layers splits over tensor-parallel ranks (`tp_plan.Split`)."""
    sliding_window: Callable[[dict[str, Any]], bool] = uses_sliding_window
    """How its config.json asks for sliding-window attention (when it has no `layer_types`)."""
    mtp_layers: bool = False
    """Its checkpoints carry multi-token-prediction layers after the last decoder layer (skipped)."""
    text_config: Callable[[dict[str, Any]], dict[str, Any]] = dict
    """The language model's config.json fields at the top level (a vision-language config nests
    them under `text_config`)."""
    decoder_prefix: str = "model."
    """Checkpoint prefix of the decoder's tensors (embedding, layers, final norm): Qwen3-VL's is
    `model.language_model.`."""
    tower_prefix: str | None = None
    """Checkpoint prefix of a vision tower's tensors (`visual.`, Qwen3-VL's `model.visual.`); natively
    they are `visual.` and the names after the prefix are the same."""


def mrope_section(cfg: dict[str, Any], *, default: list[int] | None, family: str) -> tuple[int, ...]:
    """config.json's M-RoPE split of the rotary frequency pairs (temporal, height, width); `default`
    where the config names none (transformers' for the family; None: required). ValueError otherwise."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    section = rope.get("mrope_section") or default
    if not section or len(section) != 3:
        raise ValueError(
            f"config.json rope mrope_section={section!r} is not supported (rule: three sizes, temporal, "
            f"height and width frequency pairs, as [16, 24, 24]). Fix: use a {family} config.json."
        )
    return tuple(int(s) for s in section)


def vision_fields(cfg: dict[str, Any], *, patch_size: int) -> dict[str, Any]:
    """The `VisionArgs` fields every Qwen vision tower's config.json `vision_config` names alike
    (`patch_size`: the family's default where it names none)."""
    v = cfg["vision_config"]
    return dict(
        depth=v["depth"],
        hidden_size=v["hidden_size"],
        intermediate_size=v["intermediate_size"],
        num_heads=v["num_heads"],
        out_hidden_size=v["out_hidden_size"],
        in_channels=v.get("in_channels", 3),
        patch_size=v.get("patch_size", patch_size),
        temporal_patch_size=v.get("temporal_patch_size", 2),
        spatial_merge_size=v.get("spatial_merge_size", 2),
        rope_theta=float((v.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        image_token_id=cfg["image_token_id"],
    )
