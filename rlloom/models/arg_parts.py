"""The optional parts of `ModelArgs` (args.py): a mixture of experts, multi-head latent
attention and a vision tower. Their own module because the families (families/) build them from a config.json and
args.py builds on the families: records below both keep the imports one way."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, slots=True)
class MoEArgs:
    """Mixture-of-experts feed-forward layers."""

    num_experts: int
    """Routed experts per MoE layer."""
    top_k: int
    """Experts per token."""
    intermediate_size: int
    """Hidden width of one routed expert."""
    score_func: str = "softmax"
    """softmax (Qwen3-MoE, Mixtral) or sigmoid (DeepSeek-V3)."""
    norm_topk_prob: bool = True
    """Renormalise the top-k weights to sum to one."""
    num_groups: int = 1
    """DeepSeek-V3 `n_group`: experts are split into groups for group-limited routing."""
    topk_groups: int = 1
    """DeepSeek-V3 `topk_group`: groups a token may route into."""
    routed_scaling_factor: float = 1.0
    """Multiplier of the routed weights (DeepSeek-V3)."""
    score_bias: bool = False
    """DeepSeek-V3 `e_score_correction_bias`: a per-expert bias used for choosing, not weighting."""
    num_shared_experts: int = 0
    """Always-on experts, fused into one MLP of width num_shared_experts * intermediate_size."""
    sparse_layers: tuple[int, ...] = ()
    """Indices of the decoder layers that are MoE; the others use the dense MLP."""


@dataclass(kw_only=True, slots=True)
class MLAArgs:
    """DeepSeek-V3 multi-head latent attention."""

    q_lora_rank: int | None
    """Rank of the query low-rank projection; None projects queries directly."""
    kv_lora_rank: int
    """Width of the compressed key/value latent."""
    qk_nope_head_dim: int
    """Per-head query/key channels without RoPE."""
    qk_rope_head_dim: int
    """Per-head query/key channels with RoPE (the rope key is shared by all heads)."""
    v_head_dim: int
    """Per-head value channels."""


@dataclass(kw_only=True, slots=True)
class VisionArgs:
    """A vision tower (config.json `vision_config`: Qwen2.5-VL's, or Qwen3-VL's when
    `num_position_embeddings` is set) and the image tokens of its prompts."""

    depth: int
    """Vision transformer blocks."""
    hidden_size: int
    intermediate_size: int
    """Width of each block's SwiGLU MLP (with biases)."""
    num_heads: int
    out_hidden_size: int
    """Width of the merged patch features: the language model's hidden size."""
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    """Side of the square of patches merged into one language-model token."""
    window_size: int = 112
    """Side of an attention window in pixels (blocks not in `fullatt_block_indexes`)."""
    fullatt_block_indexes: tuple[int, ...] = ()
    """Blocks that attend over the whole image instead of windows."""
    rope_theta: float = 10000.0
    num_position_embeddings: int | None = None
    """Qwen3-VL's tower: a learned square table of patch positions, resampled to each image's grid
    (no windows, LayerNorm blocks, GELU MLPs; `vision_qwen3.py`). None: Qwen2.5-VL's tower."""
    deepstack_visual_indexes: tuple[int, ...] = ()
    """Qwen3-VL's DeepStack: blocks whose merged output is added to the hidden states of the image
    tokens after decoder layer 0, 1, ... in this order."""
    image_token_id: int
    """The placeholder token each merged patch's features replace."""
