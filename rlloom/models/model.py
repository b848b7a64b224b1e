"""CausalLM: the native decoder-only transformer shared by the training and rollout engines.

Architecture only; Hugging Face names live in `adapter.py` and file I/O in `checkpoint.py`.
One class covers Llama/Qwen2/Qwen3 (GQA + SwiGLU), Qwen3-MoE/Mixtral (MoE layers), DeepSeek-V3
(MLA + MoE with shared experts after `first_k_dense_replace` dense layers), Qwen2.5-VL (a Qwen2
decoder with M-RoPE and a vision tower, `vision.py`, whose features replace the image tokens) and
Qwen3-VL (a Qwen3 decoder with interleaved M-RoPE and `vision_qwen3.py`'s tower, whose DeepStack
rows are added to the image tokens' hidden states after the first decoder layers).

Inputs (see docs/CONTRACTS.md):
- padded: input_ids [B, T] (+ attention_mask [B, T] bool, right padding) -> logits [B, T, V]
- packed: input_ids [N], position_ids [N], cu_seqlens [S + 1] -> logits [N, V]
- shared-prompt packed: the same plus prefix_lens [S] and branch_lens [Z] (each segment a prompt
  followed by branches that attend to the prompt and to themselves; see `attention_ops`)
- backend: input_ids [N], position_ids [N], attn=<object with .attn(q, k, v, scale), called once per layer>
- images (a model with a vision tower): any of the above plus pixel_values [P, C*T*ps*ps] and
  image_grid_thw [I, 3] (the processor's), or the tower's output image_embeds [M, D] (with DeepStack
  [M, 1 + K, D]); position_ids then carry a leading axis of 3 (M-RoPE, `mrope.py`): [3, N] or
  [3, B, T]. Positions without that axis are text positions (all three axes equal).

Rotary tables are recomputed buffers: after materialising from the meta device call
`init_buffers()`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from rlloom.models.args import ModelArgs
from rlloom.models.attention import Attention
from rlloom.models.attention_ops import AttnLayout, TreePlan, check_right_padded
from rlloom.models.layers import RMSNorm, RotaryEmbedding, SwiGLU
from rlloom.models.mla import MLAttention
from rlloom.models.moe import MoE
from rlloom.models.vision import VisionTower
from rlloom.models.vision_qwen3 import Qwen3VisionTower


def unwrapped_name(name: str) -> str:
    """A module or parameter name as the model's state dict has it: activation checkpointing
    (`_checkpoint_wrapped_module.`) and torch.compile (`_orig_mod.`) wrap layers in modules of their own."""
    for wrapper in ("_checkpoint_wrapped_module.", "_orig_mod."):
        name = name.replace(wrapper, "")
    return name


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + ffn(norm(x)) where ffn is a SwiGLU MLP or MoE."""

    def __init__(self, args: ModelArgs, layer_idx: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.attention = MLAttention(args) if args.mla is not None else Attention(args)
        self.ffn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        is_moe = args.moe is not None and layer_idx in args.moe.sparse_layers
        self.moe = MoE(args.hidden_size, args.moe) if is_moe else None
        self.feed_forward = (
            None if is_moe else SwiGLU(args.hidden_size, args.intermediate_size, fused=args.fused_projections)
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layout: AttnLayout,
        routes_TK: torch.Tensor | None = None,
        replay: bool = False,
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, layout)
        if self.moe is not None and routes_TK is not None:
            return h + self.moe(self.ffn_norm(h), routes_TK, replay)
        # Without routes the MoE layer takes one input, as tensor-parallel plans expect.
        ffn = self.moe if self.moe is not None else self.feed_forward
        return h + ffn(self.ffn_norm(h))


class CausalLM(nn.Module):
    """Token embedding, decoder blocks, final norm and (untied) lm head."""

    def __init__(self, args: ModelArgs, hf_config: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.args = args
        self.hf_config: dict[str, Any] = dict(hf_config or {})
        self.source_path: str | None = None
        """Folder the weights came from (tokenizer files are copied from here on save)."""
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
        self.rope = RotaryEmbedding(args.rope)
        self.layers = nn.ModuleList(TransformerBlock(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.output = (
            None if args.tie_word_embeddings else nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        )
        self.visual = _tower(args)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """[V, D] weight of the lm head (the token embedding when tied)."""
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    def init_buffers(self) -> None:
        """Recompute non-persistent buffers (RoPE inverse frequencies) after `to_empty`."""
        self.rope.init_buffers()
        if self.visual is not None:
            self.visual.init_buffers()

    def embed(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        image_embeds: torch.Tensor | None = None,
        image_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token embeddings [.., D], each image token's replaced by its image feature row in order:
        `image_embeds` [M, D], or the tower run on `pixel_values` and `image_grid_thw`. The image
        tokens are those with the placeholder id, or the flat stream's rows `image_index` [M] (the
        rollout's: a generated placeholder id is text)."""
        h = self.tok_embeddings(input_ids)
        if image_embeds is None and pixel_values is not None:
            image_embeds = self.image_features(pixel_values, image_grid_thw)
        if image_embeds is None:
            return h
        if image_embeds.dim() == 3:  # DeepStack's rows follow the merged features
            image_embeds = image_embeds[:, 0]
        if image_index is not None:
            return h.index_put((image_index,), image_embeds.to(h.dtype))
        is_image = input_ids == self.args.vision.image_token_id
        if int(is_image.sum()) != image_embeds.shape[0]:
            raise ValueError(
                f"the input holds {int(is_image.sum())} image tokens (id {self.args.vision.image_token_id}) but "
                f"its images give {image_embeds.shape[0]} feature rows. Fix: build the prompt with the "
                "processor, one placeholder run per image."
            )
        return h.masked_scatter(is_image.unsqueeze(-1), image_embeds.to(h.dtype))

    def image_features(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        """The vision tower's output, [M, D] or with DeepStack [M, 1 + K, D]."""
        if self.visual is None:
            raise ValueError(
                f"pixel_values given to a {self.args.model_type} model, which has no vision tower. "
                "Fix: use a vision-language checkpoint (Qwen2.5-VL, Qwen3-VL) or drop the images."
            )
        return self.visual(pixel_values, image_grid_thw)

    def moe_token_counts(self) -> dict[int, torch.Tensor]:
        """Layer index -> [num_experts] tokens routed to each expert in the last forward."""
        return {
            i: layer.moe.last_token_counts
            for i, layer in enumerate(self.layers)
            if layer.moe is not None and layer.moe.last_token_counts is not None
        }

    def moe_layers(self) -> dict[int, MoE]:
        """Layer index -> the layer's MoE module (empty for dense models)."""
        return {i: layer.moe for i, layer in enumerate(self.layers) if layer.moe is not None}

    def last_routes(self) -> torch.Tensor | None:
        """[T, MoE layers, K] experts used per token in the last forward; None for dense models."""
        moes = list(self.moe_layers().values())
        if not moes or any(m.last_experts_TK is None for m in moes):
            return None
        return torch.stack([m.last_experts_TK for m in moes], dim=1)

    def route_mismatch(self) -> torch.Tensor | None:
        """[2] (tokens x layers whose experts differ from the given routes, tokens x layers compared)
        summed over the MoE layers of the last forward that was given routes."""
        found = [
            m.last_route_mismatch for m in self.moe_layers().values() if m.last_route_mismatch is not None
        ]
        return torch.stack(found).sum(dim=0) if found else None

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        *,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        attention_mask: torch.Tensor | None = None,
        attn: Any = None,
        prefix_lens: torch.Tensor | None = None,
        branch_lens: torch.Tensor | None = None,
        tree: TreePlan | None = None,
        routes_NLK: torch.Tensor | None = None,
        replay_routes: bool = False,
        layers: Sequence[nn.Module] | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        image_embeds: torch.Tensor | None = None,
        image_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states [.., D] (no lm head); arguments as in `forward`, plus `layers`:
        the decoder layers to run instead of `self.layers` (the rollout's compiled ones), and `tree`:
        the shared-prompt structure as a `TreePlan` the caller built on the host, instead of
        prefix_lens/branch_lens (a wrapper such as FSDP would copy those tensors to the GPU, and
        reading them back there costs a host sync); and `routes_NLK` [N, MoE layers, K], the experts
        the rollout chose per token (-1 = none), replayed with `replay_routes` (see moe.py); images
        as `embed` takes them."""
        layout, position_ids = _layout(input_ids, position_ids, cu_seqlens, max_seqlen, attention_mask, attn)
        if tree is not None or prefix_lens is not None or branch_lens is not None:
            layout = _tree_layout(layout, prefix_lens, branch_lens, input_ids.device, tree)
        if image_embeds is None and pixel_values is not None:
            image_embeds = self.image_features(pixel_values, image_grid_thw)
        h = self.embed(input_ids, image_embeds=image_embeds, image_index=image_index)
        deepstack = _deepstack_rows(self.args, input_ids, image_embeds, image_index)
        cos, sin = self.rope(position_ids, h.dtype, axes3=position_ids.dim() > input_ids.dim())
        moe_index = 0
        for i, layer in enumerate(self.layers if layers is None else layers):
            if layer.moe is not None and routes_NLK is not None:
                h = layer(h, cos, sin, layout, routes_NLK[:, moe_index], replay_routes)
                moe_index += 1
            else:
                h = layer(h, cos, sin, layout)
            if deepstack is not None and i < deepstack[1].shape[1]:
                rows = deepstack[0]
                h = h.index_put(rows, h[rows] + deepstack[1][:, i].to(h.dtype))
        return self.norm(h)

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        attention_mask: torch.Tensor | None = None,
        attn: Any = None,
        prefix_lens: torch.Tensor | None = None,
        branch_lens: torch.Tensor | None = None,
        routes_NLK: torch.Tensor | None = None,
        replay_routes: bool = False,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        image_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [B, T, V] (padded input) or [N, V] (packed or backend input).

        A padded batch must be right-padded; `attention_mask` is checked for that and the causal mask
        then keeps padding out of every real position (logits at pad positions are meaningless).
        `prefix_lens` [S] and `branch_lens` [Z] (with `cu_seqlens`) make a packed stream a
        shared-prompt stream, as `PackedTensors.prefix_lens_S` and `branch_lens_Z` describe.
        """
        h = self.hidden_states(
            input_ids,
            position_ids=position_ids,
            cu_seqlens=cu_seqlens,
            max_seqlen=max_seqlen,
            attention_mask=attention_mask,
            attn=attn,
            prefix_lens=prefix_lens,
            branch_lens=branch_lens,
            routes_NLK=routes_NLK,
            replay_routes=replay_routes,
            pixel_values=pixel_values,
            image_grid_thw=image_grid_thw,
            image_embeds=image_embeds,
        )
        return h @ self.lm_head_weight.T


def _tower(args: ModelArgs) -> nn.Module | None:
    """The vision tower config.json describes: Qwen3-VL's when it has a learned position table."""
    if args.vision is None:
        return None
    return (
        VisionTower(args.vision)
        if args.vision.num_position_embeddings is None
        else Qwen3VisionTower(args.vision)
    )


def _deepstack_rows(
    args: ModelArgs,
    input_ids: torch.Tensor,
    image_embeds: torch.Tensor | None,
    image_index: torch.Tensor | None,
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor] | None:
    """(index of the image tokens in the hidden states, [M, K, D] the DeepStack rows added there after
    decoder layers 0..K-1), or None without DeepStack (Qwen3-VL's, transformers' `_deepstack_process`)."""
    if image_embeds is None or image_embeds.dim() != 3:
        return None
    if image_index is not None:
        return (image_index,), image_embeds[:, 1:]
    return torch.nonzero(input_ids == args.vision.image_token_id, as_tuple=True), image_embeds[:, 1:]


def _layout(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    max_seqlen: int | None,
    attention_mask: torch.Tensor | None,
    attn: Any,
) -> tuple[AttnLayout, torch.Tensor]:
    """Validate the argument combination; return the layout and the position ids."""
    if attn is not None:
        if input_ids.dim() != 1 or position_ids is None:
            raise ValueError(
                f"CausalLM.forward with attn=<backend>: input_ids must be flat [N] (got shape "
                f"{tuple(input_ids.shape)}) and position_ids [N] is required (got "
                f"{None if position_ids is None else tuple(position_ids.shape)}). Fix: pass the flat stream."
            )
        return AttnLayout(kind="backend", backend=attn), position_ids
    if input_ids.dim() == 2:
        if cu_seqlens is not None:
            raise ValueError(
                f"CausalLM.forward: cu_seqlens is for a packed [N] stream but input_ids has shape "
                f"{tuple(input_ids.shape)}. Fix: flatten the batch to [N] or drop cu_seqlens."
            )
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        if attention_mask is not None:
            check_right_padded(attention_mask)
        return AttnLayout(kind="padded"), position_ids
    if input_ids.dim() != 1:
        raise ValueError(
            f"CausalLM.forward: input_ids must be [B, T] or [N], got shape {tuple(input_ids.shape)}."
        )
    if attention_mask is not None:
        raise ValueError(
            "CausalLM.forward: attention_mask is for a padded [B, T] batch, not a packed [N] stream."
        )
    num_tokens = input_ids.shape[0]
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, num_tokens], dtype=torch.int32, device=input_ids.device)
    if position_ids is None:
        if len(cu_seqlens) != 2:
            raise ValueError(
                "CausalLM.forward: a packed stream of several sequences needs position_ids [N] restarting "
                "at 0 per sequence. Fix: pass PackedTensors.position_ids_N."
            )
        position_ids = torch.arange(num_tokens, device=input_ids.device)
    return AttnLayout(kind="packed", cu_seqlens=cu_seqlens, max_seqlen=max_seqlen), position_ids


def _tree_layout(
    layout: AttnLayout,
    prefix_lens: torch.Tensor | None,
    branch_lens: torch.Tensor | None,
    device: torch.device,
    tree: TreePlan | None = None,
) -> AttnLayout:
    """The packed layout with shared-prompt segments; stays 'packed' when no segment branches."""
    if tree is not None:
        if layout.kind != "packed" or prefix_lens is not None or branch_lens is not None:
            raise ValueError(
                "CausalLM.forward: tree describes a packed [N] stream (with cu_seqlens) and replaces "
                "prefix_lens/branch_lens. Fix: pass either tree or prefix_lens and branch_lens."
            )
    elif layout.kind != "packed" or prefix_lens is None or branch_lens is None:
        raise ValueError(
            "CausalLM.forward: prefix_lens and branch_lens describe a packed [N] stream and come together "
            f"(got a {layout.kind} input, prefix_lens {'set' if prefix_lens is not None else 'None'}, "
            f"branch_lens {'set' if branch_lens is not None else 'None'}). Fix: pass both with cu_seqlens."
        )
    if tree is None:
        tree = TreePlan(layout.cu_seqlens, prefix_lens, branch_lens, device)
    if not tree.has_branches:  # every segment is one causal sequence: keep the packed kernels
        return layout
    return AttnLayout(kind="tree", cu_seqlens=layout.cu_seqlens, max_seqlen=layout.max_seqlen, tree=tree)
