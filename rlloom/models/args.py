"""ModelArgs: the architecture hyper-parameters of a native model, read from a Hugging Face config.

One dataclass covers every supported family; the optional `moe` and `mla` parts are None for the
dense models. `ModelArgs.from_hf_config(config_dict)` is the only way in from a `config.json`, and it
raises a ValueError naming the field for anything we do not implement (an unknown architecture, an
active sliding window, an unknown RoPE scaling type) instead of silently computing something else.

Supported `model_type`s: llama, qwen2, qwen3 (dense); qwen3_moe, mixtral (MoE with softmax
routing); deepseek_v3 (MLA attention, sigmoid group-limited routing, shared experts). What differs
between them is read by their family's module (rlloom/models/families/); this module reads the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlloom.models.arg_parts import MLAArgs, MoEArgs, VisionArgs
from rlloom.models.families import FAMILIES

__all__ = ["KVCacheShape", "MLAArgs", "ModelArgs", "MoEArgs", "RopeArgs", "VisionArgs", "rope_args"]

_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(kw_only=True, slots=True)
class RopeArgs:
    """Rotary position embedding: base frequency and the optional context-extension scaling."""

    theta: float = 10000.0
    """Base of the inverse frequencies (`rope_theta`)."""
    dim: int = 64
    """Number of rotated channels per head (head_dim, or qk_rope_head_dim for MLA)."""
    rope_type: str = "default"
    """One of default, linear, llama3, yarn."""
    factor: float = 1.0
    """Context extension factor (linear, llama3, yarn)."""
    low_freq_factor: float = 1.0
    """llama3: wavelengths above original_max / low_freq_factor are divided by `factor`."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths below original_max / high_freq_factor are kept."""
    original_max_position_embeddings: int = 0
    """llama3 and yarn: context length the model was pre-trained with."""
    beta_fast: float = 32.0
    """yarn: rotations bounding the extrapolated band."""
    beta_slow: float = 1.0
    """yarn: rotations bounding the interpolated band."""
    mscale: float = 0.0
    """yarn: mscale (DeepSeek); 0 means unset."""
    mscale_all_dim: float = 0.0
    """yarn: mscale_all_dim (DeepSeek); 0 means unset."""
    attention_factor: float | None = None
    """yarn: explicit cos/sin scaling; None derives it from factor and the mscales."""
    truncate: bool = True
    """yarn: round the correction range to whole channels."""
    interleaved: bool = False
    """Rotate channel pairs (2i, 2i+1) instead of halves (DeepSeek-V3 `rope_interleave`)."""
    mrope_section: tuple[int, ...] | None = None
    """M-RoPE (Qwen2.5-VL): consecutive frequency pairs driven by the temporal, height and width
    position (e.g. 16, 24, 24 of 64 pairs); None for one position per token."""
    mrope_interleaved: bool = False
    """M-RoPE's pairs interleaved (Qwen3-VL): pair j reads height when j % 3 == 1 and j < 3 * section[1],
    width when j % 3 == 2 and j < 3 * section[2], else the temporal position."""


@dataclass(frozen=True, kw_only=True, slots=True)
class KVCacheShape:
    """Per token and layer: `num_heads` cached heads of `key_dim` key and `value_dim` value channels.
    With `value_in_key` the values are the first `value_dim` key channels and take no memory of
    their own (MLA's latent)."""

    num_heads: int
    key_dim: int
    value_dim: int
    value_in_key: bool = False

    @property
    def values_per_token(self) -> int:
        """Cached numbers per token and layer."""
        return self.num_heads * (self.key_dim + (0 if self.value_in_key else self.value_dim))


@dataclass(kw_only=True, slots=True)
class ModelArgs:
    """Hyper-parameters of a decoder-only causal LM."""

    model_type: str
    """Hugging Face `model_type`: selects the state-dict adapter."""
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    """Per-head query/key width (MLA: qk_nope_head_dim + qk_rope_head_dim)."""
    intermediate_size: int
    """Width of the dense SwiGLU MLP."""
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    """The lm head reuses the token embedding."""
    attention_bias: bool = False
    """Biases on the q/k/v projections (Qwen2, optional for Llama/Qwen3); MLA: on q_a, kv_a and o."""
    attention_out_bias: bool = False
    """Bias on the output projection (Llama/Qwen3 with attention_bias; never Qwen2)."""
    qk_norm: bool = False
    """RMSNorm over each head of q and k before RoPE (Qwen3)."""
    rope: RopeArgs
    moe: MoEArgs | None = None
    mla: MLAArgs | None = None
    vision: VisionArgs | None = None
    """A vision tower whose image features replace the prompt's image tokens (Qwen2.5-VL)."""
    fused_projections: bool = False
    """Layout, not architecture: q/k/v (GQA) and the dense MLP's gate/up run as one matmul each
    (`layers.FusedLinear`). The rollout engine's models use it; checkpoints are the same."""

    @property
    def v_head_dim(self) -> int:
        return self.mla.v_head_dim if self.mla is not None else self.head_dim

    @property
    def kv_cache(self) -> KVCacheShape:
        """What the rollout engine caches per token and layer: MLA caches its compressed latent
        (one shared "head" of kv_lora_rank + qk_rope_head_dim channels; the values are its first
        kv_lora_rank channels), everything else keys and values per KV head."""
        if self.mla is not None:
            m = self.mla
            return KVCacheShape(
                num_heads=1,
                key_dim=m.kv_lora_rank + m.qk_rope_head_dim,
                value_dim=m.kv_lora_rank,
                value_in_key=True,
            )
        return KVCacheShape(num_heads=self.num_kv_heads, key_dim=self.head_dim, value_dim=self.head_dim)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArgs:
        """Build from a `config.json` dict; ValueError for anything not supported."""
        model_type = cfg.get("model_type")
        if model_type not in FAMILIES:
            raise ValueError(
                f"config.json model_type={model_type!r} (architectures={cfg.get('architectures')}) is not "
                f"supported by rlloom.models; supported model types: {', '.join(FAMILIES)}. "
                "Fix: use a checkpoint of a supported family or add an adapter in rlloom/models/."
            )
        family = FAMILIES[model_type]
        cfg = family.text_config(cfg)
        _check_no_sliding_window(cfg, family.sliding_window)
        if cfg.get("mlp_bias"):
            raise ValueError(
                "config.json mlp_bias=true is not supported (rule: MLP projections have no bias). "
                "Fix: use a checkpoint without MLP biases."
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(
                f"config.json hidden_act={cfg['hidden_act']!r} is not supported (rule: 'silu', SwiGLU). "
                "Fix: use a checkpoint with SwiGLU MLPs."
            )
        own = family.args(cfg)
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        mla = own.mla
        if mla is not None:
            head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        rope_dim = mla.qk_rope_head_dim if mla is not None else head_dim
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=num_heads if mla is not None else cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            intermediate_size=cfg["intermediate_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=own.attention_bias,
            attention_out_bias=own.attention_out_bias,
            qk_norm=own.qk_norm,
            rope=rope_args(
                cfg,
                rope_dim,
                interleaved=own.rope_interleaved,
                mrope_section=own.mrope_section,
                mrope_interleaved=own.mrope_interleaved,
            ),
            moe=own.moe,
            mla=mla,
            vision=own.vision,
        )


def language_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json with the language model's fields at the top level, where the start-up checks and
    the planner read them (a vision-language config nests them under `text_config`)."""
    family = FAMILIES.get(cfg.get("model_type"))  # type: ignore[arg-type]
    return cfg if family is None else family.text_config(cfg)


def _check_no_sliding_window(cfg: dict[str, Any], family_window: Callable[[dict[str, Any]], bool]) -> None:
    layer_types = cfg.get("layer_types") or []
    uses_window = any(t != "full_attention" for t in layer_types) if layer_types else family_window(cfg)
    if uses_window:
        raise ValueError(
            f"config.json asks for sliding-window attention (sliding_window={cfg.get('sliding_window')}, "
            f"use_sliding_window={cfg.get('use_sliding_window')}, layer_types={layer_types or None}); "
            "rlloom.models implements full causal attention only. Fix: use a checkpoint without sliding "
            "windows or set use_sliding_window=false if the window exceeds your sequence lengths."
        )


def _rope_dict(cfg: dict[str, Any]) -> dict[str, Any]:
    """The RoPE parameters from either transformers 5 (`rope_parameters`) or 4 (`rope_scaling`)."""
    params = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling") or {}
    for key, value in legacy.items():
        params.setdefault(key, value)
    if "rope_type" not in params:
        params["rope_type"] = params.get("type", "default")
    if params["rope_type"] == "mrope":  # the Hub's Qwen2.5-VL name for default frequencies, 3-D positions
        params["rope_type"] = "default"
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    return params


def rope_args(
    cfg: dict[str, Any],
    dim: int,
    *,
    interleaved: bool = False,
    mrope_section: tuple[int, ...] | None = None,
    mrope_interleaved: bool = False,
) -> RopeArgs:
    """RopeArgs for `dim` rotated channels from an HF config dict."""
    p = _rope_dict(cfg)
    rope_type = p["rope_type"]
    if rope_type not in _ROPE_TYPES:
        raise ValueError(
            f"config.json rope type {rope_type!r} is not supported; supported: {', '.join(_ROPE_TYPES)}. "
            "Fix: use a checkpoint with one of these RoPE scalings."
        )
    if p.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(
            f"config.json partial_rotary_factor={p['partial_rotary_factor']} is not supported (rule: 1.0). "
            "Fix: use a checkpoint that rotates all head channels."
        )
    return RopeArgs(
        theta=float(p["rope_theta"]),
        dim=dim,
        rope_type=rope_type,
        factor=float(p.get("factor") or 1.0),
        low_freq_factor=float(p.get("low_freq_factor") or 1.0),
        high_freq_factor=float(p.get("high_freq_factor") or 4.0),
        original_max_position_embeddings=int(
            p.get("original_max_position_embeddings") or cfg.get("max_position_embeddings") or 0
        ),
        beta_fast=float(p.get("beta_fast") or 32.0),
        beta_slow=float(p.get("beta_slow") or 1.0),
        mscale=float(p.get("mscale") or 0.0),
        mscale_all_dim=float(p.get("mscale_all_dim") or 0.0),
        attention_factor=p.get("attention_factor"),
        truncate=bool(p.get("truncate", True)),
        interleaved=bool(interleaved),
        mrope_section=mrope_section,
        mrope_interleaved=mrope_interleaved,
    )
