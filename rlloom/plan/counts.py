"""What a model costs per layer: parameter counts, activation elements per token, KV-cache bytes.

`model_costs(args)` reads a `ModelArgs` (built from config.json, no weights) and returns one
`LayerCost` per decoder layer plus the embedding and head. MLA (DeepSeek-V3), MoE with routed and
shared experts and leading dense layers, GQA with QK-norm and biases, and tied or untied heads are
covered. Multi-token-prediction (MTP) layers are not counted: `num_hidden_layers` excludes them and
RL training does not train them (verl and slime disable MTP), so they are neither trained nor served.

Activation counts are bf16 elements saved for backward per token of one layer, before any division
by tensor or context parallelism; docs/plan.md derives each term.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlloom.models.args import ModelArgs, VisionArgs
from rlloom.models.lora import parse_targets


@dataclass(frozen=True, slots=True)
class LayerCost:
    """One decoder layer."""

    dense_params: int
    """Attention, norms, router, shared experts or the dense MLP: sharded over TP and FSDP."""
    expert_params: int
    """Routed experts: sharded over EP and the expert FSDP axis."""
    act_none: int
    """bf16 elements saved per token with no recompute (routed copies counted top_k times)."""
    act_selective: int
    """bf16 elements saved per token when norms, RoPE and the SwiGLU product are recomputed."""
    kv_bytes_per_token: int
    """Rollout KV-cache bytes per token (bf16; MLA caches the compressed latent)."""
    is_moe: bool


@dataclass(frozen=True, slots=True)
class ModelCosts:
    """The whole model as the planner sees it."""

    layers: tuple[LayerCost, ...]
    embed_params: int
    """Token embedding (on the first pipeline stage)."""
    head_params: int
    """Untied lm head plus the final norm (on the last stage); a tied head is a second copy there."""
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    num_experts: int
    """Routed experts per MoE layer (0 for dense models)."""
    top_k: int
    tied: bool
    mla: bool
    """Multi-head latent attention: the KV cache holds one latent per token, not split over TP."""
    cp_gathered: int
    """bf16 elements per token that context parallelism all-gathers in each layer: every key and value
    channel of every key/value head (MLA: its per-head keys and values)."""
    cp_run_width: int
    """bf16 elements per key of CP's FlashAttention runs: keys and values repeated to the query
    heads (torch 2.11's varlen kernel has no GQA), MLA's values zero-padded to the key width."""

    total_params: int
    """Parameters of the checkpoint's trained part (a tied head counted once)."""
    expert_params: int
    """Routed-expert parameters of all layers."""
    tower_params: int = 0
    """A vision tower's parameters (Qwen2.5-VL, Qwen3-VL; in the first stage's root unit, with the
    embedding). 0: a text model."""
    tower_act_per_patch: int = 0
    """bf16 elements the vision tower saves for backward per patch of the pictures (they scale with
    the pictures, not the tokens: `Workload.image_patches_per_gpu`)."""


ROUTING_PER_COPY = 3 * 4 + 2 + 1
"""bf16 elements an MoE layer saves per routed copy besides the expert activations
(rlloom/models/moe.py): the chosen expert id (kept by the weights' gather), the copy's position in
the expert-sorted order (kept by the weights' permutation) and its token (kept by the gather of the
inputs and the index_add of the outputs), each int64 = 4 bf16 elements; the routing weight in fp32
(2) and its bf16 copy that scales the expert output (1)."""


def _attention(args: ModelArgs) -> tuple[int, int, int]:
    """(params, activation elements per token: none, selective) of the attention block with its norm."""
    h, a = args.hidden_size, args.num_heads
    if args.mla is not None:
        m = args.mla
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank:
            q = h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * a * qk
            q_acts = 2 * m.q_lora_rank + a * qk  # q_a output, its norm, q_b output
        else:
            q, q_acts = h * a * qk, a * qk
        kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
        kv += m.kv_lora_rank * a * (m.qk_nope_head_dim + m.v_head_dim)
        o = a * m.v_head_dim * h
        bias = (m.q_lora_rank or a * qk) + m.kv_lora_rank + m.qk_rope_head_dim + h
        params = q + kv + o + (bias if args.attention_bias else 0) + h  # + input norm
        # kv_a output + its norm, kv_b output; per-head q/k after RoPE, v, attention output
        kv_acts = 2 * m.kv_lora_rank + m.qk_rope_head_dim + a * (m.qk_nope_head_dim + m.v_head_dim)
        core = 2 * a * qk + a * m.v_head_dim + a * m.v_head_dim
        none = 2 * h + q_acts + kv_acts + core
        selective = h + (a * qk) + a * (m.qk_nope_head_dim + m.v_head_dim) + core
        return params, none, selective
    d, k = args.head_dim, args.num_kv_heads
    params = 2 * h * a * d + 2 * h * k * d + h  # q, o, k, v, input norm
    if args.attention_bias:
        params += a * d + 2 * k * d
    if args.attention_out_bias:
        params += h
    if args.qk_norm:
        params += 2 * d
    qkv = a * d + 2 * k * d
    # norm in/out, q/k/v, q/k after norm+RoPE, the attention output and its copy in the output
    # projection's layout (measured on an H200 with torch.compile: docs/plan.md, section 2)
    none = 2 * h + qkv + (a * d + k * d) + 2 * a * d
    selective = h + qkv + a * d
    return params, none, selective


def _cp_attention(args: ModelArgs) -> tuple[int, int]:
    """(ModelCosts.cp_gathered, ModelCosts.cp_run_width) of `args`."""
    a = args.num_heads
    if args.mla is not None:
        m = args.mla
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        return a * (qk + m.v_head_dim), 2 * a * qk
    return 2 * args.num_kv_heads * args.head_dim, 2 * a * args.head_dim


def _kv_bytes_per_token(args: ModelArgs) -> int:
    if args.mla is not None:
        return 2 * (args.mla.kv_lora_rank + args.mla.qk_rope_head_dim)
    return 2 * 2 * args.num_kv_heads * args.head_dim


def _feed_forward(args: ModelArgs, is_moe: bool) -> tuple[int, int, int, int]:
    """(dense params, expert params, activations none, selective) of the MLP block with its norm."""
    h = args.hidden_size
    if not is_moe:
        ffn = args.intermediate_size
        return 3 * h * ffn + h, 0, 2 * h + 3 * ffn, h + 2 * ffn
    moe = args.moe
    assert moe is not None
    f, shared = moe.intermediate_size, moe.num_shared_experts * moe.intermediate_size
    dense = moe.num_experts * h + 3 * h * shared + h + (moe.num_experts if moe.score_bias else 0)
    experts = moe.num_experts * 3 * h * f
    # router scores (fp32 = 2 bf16 elements each), per routed copy: permuted input, gate, up,
    # product, expert output (balanced routing: top_k copies per token), its routing bookkeeping;
    # the shared expert.
    routed_none = moe.top_k * (2 * h + 3 * f + ROUTING_PER_COPY)
    routed_sel = moe.top_k * (h + 2 * f + ROUTING_PER_COPY)
    none = 2 * h + 2 * moe.num_experts + routed_none + 3 * shared
    selective = h + routed_sel + 2 * shared
    return dense, experts, none, selective


def model_costs(args: ModelArgs) -> ModelCosts:
    """Per-layer costs of `args` (MTP layers excluded; see the module docstring)."""
    attn_params, attn_none, attn_sel = _attention(args)
    sparse = set(args.moe.sparse_layers) if args.moe is not None else set()
    layers = []
    for i in range(args.num_layers):
        dense, experts, ff_none, ff_sel = _feed_forward(args, i in sparse)
        layers.append(
            LayerCost(
                dense_params=attn_params + dense,
                expert_params=experts,
                act_none=attn_none + ff_none,
                act_selective=attn_sel + ff_sel,
                kv_bytes_per_token=_kv_bytes_per_token(args),
                is_moe=i in sparse,
            )
        )
    vocab_hidden = args.vocab_size * args.hidden_size
    tower = vision_tower_params(args.vision) if args.vision is not None else 0
    cp_gathered, cp_run_width = _cp_attention(args)
    body = sum(layer.dense_params + layer.expert_params for layer in layers)
    head = vocab_hidden + args.hidden_size - (vocab_hidden if args.tie_word_embeddings else 0)
    return ModelCosts(
        layers=tuple(layers),
        embed_params=vocab_hidden,
        head_params=vocab_hidden + args.hidden_size,
        hidden_size=args.hidden_size,
        vocab_size=args.vocab_size,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        num_experts=args.moe.num_experts if args.moe is not None else 0,
        top_k=args.moe.top_k if args.moe is not None else 0,
        tied=args.tie_word_embeddings,
        mla=args.mla is not None,
        cp_gathered=cp_gathered,
        cp_run_width=cp_run_width,
        total_params=body + vocab_hidden + head + tower,
        expert_params=sum(layer.expert_params for layer in layers),
        tower_params=tower,
        tower_act_per_patch=vision_tower_act_per_patch(args.vision) if args.vision is not None else 0,
    )


def vision_tower_params(v: VisionArgs) -> int:
    """Parameters of Qwen2.5-VL's vision tower (rlloom/models/vision.py) or Qwen3-VL's
    (`vision_qwen3.py`: LayerNorms with biases, a two-matrix MLP, a learned position table, a
    patch bias and one more merger per DeepStack block, normed over the merged width)."""
    h, i = v.hidden_size, v.intermediate_size
    patch = h * v.in_channels * v.temporal_patch_size * v.patch_size**2
    width = h * v.spatial_merge_size**2
    mlp = (width * width + width) + (width * v.out_hidden_size + v.out_hidden_size)
    attention = (3 * h * h + 3 * h) + (h * h + h)
    if v.num_position_embeddings is None:
        block = 2 * h + attention + 2 * (h * i + i) + (i * h + h)
        return patch + v.depth * block + h + mlp
    block = 4 * h + attention + (h * i + i) + (i * h + h)
    deepstack = len(v.deepstack_visual_indexes) * (2 * width + mlp)
    tower = patch + h + v.num_position_embeddings * h + v.depth * block
    return tower + 2 * h + mlp + deepstack


def vision_tower_act_per_patch(v: VisionArgs) -> int:
    """bf16 elements the vision tower saves for backward per patch, nothing recomputed (activation
    checkpointing wraps the decoder layers only): the patch embedding's input; per block its
    attention's as a decoder layer's with a key and value per head (norm in and out, q/k/v, q/k after
    RoPE, the output and its copy: `_attention`) and its MLP's (norm in and out, then SwiGLU's gate,
    up and product, or the two-matrix MLP's hidden and its GELU); each merger's normed input, hidden
    and GELU (width merge^2 x hidden per merged token: 3 x hidden per patch)."""
    h, i = v.hidden_size, v.intermediate_size
    mlp = 2 * h + (3 * i if v.num_position_embeddings is None else 2 * i)
    block = 9 * h + mlp
    mergers = 1 + len(v.deepstack_visual_indexes)
    return v.in_channels * v.temporal_patch_size * v.patch_size**2 + v.depth * block + mergers * 3 * h


def value_model_params(costs: ModelCosts) -> int:
    """Parameters of PPO's critic started from this model: its body and a value head instead of the
    vocabulary head (a tied head is the embedding, which the critic keeps)."""
    return (
        costs.total_params
        - (0 if costs.tied else costs.vocab_size * costs.hidden_size)
        + costs.hidden_size
        + 1
    )


def _projections(args: ModelArgs, is_moe: bool) -> dict[str, tuple[int, int]]:
    """(in, out) features of one decoder layer's projections that LoRA can target, by native name:
    the attention's and the dense MLP's (an MoE layer's shared experts; routed experts never)."""
    h, a = args.hidden_size, args.num_heads
    if args.mla is not None:
        m = args.mla
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        attn = {"wkv_a": (h, m.kv_lora_rank + m.qk_rope_head_dim)}
        attn["wkv_b"] = (m.kv_lora_rank, a * (m.qk_nope_head_dim + m.v_head_dim))
        attn["wo"] = (a * m.v_head_dim, h)
        if m.q_lora_rank:
            attn |= {"wq_a": (h, m.q_lora_rank), "wq_b": (m.q_lora_rank, a * qk)}
        else:
            attn["wq"] = (h, a * qk)
    else:
        d, k = args.head_dim, args.num_kv_heads
        attn = {"wq": (h, a * d), "wk": (h, k * d), "wv": (h, k * d), "wo": (a * d, h)}
    if not is_moe:
        width = args.intermediate_size
    else:
        assert args.moe is not None
        width = args.moe.num_shared_experts * args.moe.intermediate_size
    mlp = {"w1": (h, width), "w3": (h, width), "w2": (width, h)} if width else {}
    return attn | mlp


def lora_params(args: ModelArgs, rank: int, targets: str) -> int:
    """Trainable parameters of `train.lora_rank=rank` adapters on `targets` (a
    `train.lora_target_modules` value): rank x (in + out) per adapted projection (models/lora.py)."""
    wanted = parse_targets(targets)
    sparse = set(args.moe.sparse_layers) if args.moe is not None else set()
    return sum(
        rank * (fan_in + fan_out)
        for i in range(args.num_layers)
        for name, (fan_in, fan_out) in _projections(args, i in sparse).items()
        if wanted is None or name in wanted
    )
