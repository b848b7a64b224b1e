"""`PolicyHead`: the causal LM and its chunked logprob head as one module with one `forward`.

FSDP hooks run around a module's `forward`, so the head's weight (the lm head or the tied embedding,
owned by the root FSDP unit) must be used inside the root's forward. Wrapping hidden states and
`token_logprobs` in one forward does that, and lets the head run only at the positions that predict
a trained response token instead of over the whole packed stream.

Under tensor parallelism the hidden states come as token shards and the head weight is sharded over
the vocabulary: the selected positions are gathered from the all-gathered stream and the head runs
on the local vocabulary slice (`rlloom.parallel.vocab_parallel`), never building full logits. The
packed stream is padded to a multiple of tp tokens with a segment of its own at the end, which no
real position attends to and no selected position reads.

Shape legend: N tokens in the packed stream, S segments, Z branches of shared-prompt segments,
K selected positions, D hidden size, b samples of a micro-batch, T response tokens.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from rlloom.data.types import PackedTensors, RolloutBatch
from rlloom.devices import to_device
from rlloom.engines.train.base import ForwardOptions
from rlloom.models.arg_parts import VisionArgs
from rlloom.models.attention_ops import TreePlan
from rlloom.models.exact import exact_numerics
from rlloom.models.logprobs import token_logprobs
from rlloom.models.mrope import stream_positions
from rlloom.parallel.cp import CPShard, check_cp_layout
from rlloom.parallel.vocab_parallel import vocab_parallel_token_logprobs


class StreamHead(nn.Module):
    """A CausalLM (`self.model`) read out by a head at K positions of its packed stream, as one module
    with one `forward`: `PolicyHead` (logprobs) and the critic's `ValueHead` (values) give `head`."""

    exact = False
    """Batch-invariant numerics in the forward (rollout.match_training; models/exact.py)."""

    def forward(
        self,
        input_ids_N: torch.Tensor,
        position_ids_N: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        positions_K: torch.Tensor,
        targets_K: torch.Tensor,
        options: ForwardOptions,
        tree: TreePlan | None = None,
        routes_NLK: torch.Tensor | None = None,
        cp: CPShard | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        image_index_M: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The head's fp32 [K] results at `positions_K` (and entropy [K] or None).

        input_ids_N, position_ids_N: [N]; cu_seqlens: [S + 1] int32; positions_K, targets_K: [K] int64
        (positions may repeat: a shared prompt's last position predicts the first token of each
        branch); tree: the shared-prompt layout built on the host (a `TreePlan`: FSDP leaves it
        alone, where it would copy tensors to the GPU), or None for plain packed sequences;
        options: temperature, entropy, routing replay; routes_NLK: the rollout's experts per
        position for MoE models (compared, or with routing replay replayed: see rlloom/models/moe.py); cp: under context parallelism, this rank's
        share of the stream (the inputs and positions are then local, and the shard's attention
        replaces cu_seqlens); pixel_values, image_grid_thw, image_index_M: the stream's pictures and
        the rows of its image tokens (a vision-language model; position_ids_N is then [3, N]).
        """
        with exact_numerics(self.exact):
            hidden_ND = self.model.hidden_states(
                input_ids_N,
                position_ids=position_ids_N,
                cu_seqlens=None if cp is not None else cu_seqlens,
                max_seqlen=max_seqlen,
                tree=tree,
                routes_NLK=routes_NLK,
                replay_routes=options.routing_replay,
                attn=cp,
                pixel_values=pixel_values,
                image_grid_thw=image_grid_thw,
                image_index=image_index_M,
            )
            return self.head(hidden_ND, positions_K, targets_K, options)

    def head(
        self,
        hidden_ND: torch.Tensor,
        positions_K: torch.Tensor,
        targets_K: torch.Tensor,
        options: ForwardOptions,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The head on the stream's final hidden states [N, D] (token shards under TP) at K positions."""
        raise NotImplementedError


class PolicyHead(StreamHead):
    """Wraps a CausalLM (`self.model`); `forward` returns logprobs (and entropies) at K positions."""

    def __init__(self, model: nn.Module, *, chunk_tokens: int, fused_head: bool = False) -> None:
        super().__init__()
        self.model = model
        self.chunk_tokens = chunk_tokens
        self.fused_head = fused_head
        """Run the head's elementwise passes as Triton kernels (CUDA; see models/logprobs.py)."""

    def head(
        self,
        hidden_ND: torch.Tensor,
        positions_K: torch.Tensor,
        targets_K: torch.Tensor,
        options: ForwardOptions,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """fp32 log p(targets_K[k] | what position positions_K[k] attends to) [K], and entropy [K] or None."""
        num_selected = positions_K.shape[0]
        if num_selected == 0:
            # Run the head on one position and keep none of it: the result is still connected to
            # every parameter, so backward gives (zero) gradients everywhere, as on other ranks.
            positions_K = positions_K.new_zeros(1)
            targets_K = targets_K.new_zeros(1)
        weight_VD = self.model.lm_head_weight
        if isinstance(weight_VD, DTensor):  # tensor parallel: token shards, vocabulary-sharded head
            if isinstance(hidden_ND, DTensor):
                hidden_ND = hidden_ND.redistribute(hidden_ND.device_mesh, [Replicate()]).to_local()
            logp_K, entropy_K = vocab_parallel_token_logprobs(
                hidden_ND[positions_K],
                weight_VD,
                targets_K,
                temperature=options.temperature,
                chunk_tokens=self.chunk_tokens,
                with_entropy=options.with_entropy,
            )
        else:
            logp_K, entropy_K = token_logprobs(
                hidden_ND[positions_K],
                weight_VD,
                targets_K,
                temperature=options.temperature,
                chunk_tokens=self.chunk_tokens,
                with_entropy=options.with_entropy,
                # Exact: the passes keep exact numerics' log-sum-exp, the sampler's (logprobs._kernels).
                fused=self.fused_head,
            )
        if num_selected == 0:
            logp_K = logp_K[:0]
            entropy_K = entropy_K[:0] if entropy_K is not None else None
        return logp_K, entropy_K


def run_micro_batch(
    module: nn.Module,
    batch: RolloutBatch,
    device: torch.device,
    options: ForwardOptions,
    *,
    share_prompts: bool = False,
    pad_multiple: int = 1,
    cp_group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, int, int]:
    """Pack `batch` (one micro-batch; shared-prompt layout with `share_prompts`), run `module` (a
    PolicyHead, maybe FSDP-wrapped) on it with `options`; with routing replay an MoE model uses the experts the
    rollout recorded in the samples (routing replay); the stream is padded to a multiple of
    `pad_multiple` tokens (the tensor-parallel degree). With `cp_group` (context parallelism) each
    rank runs its share of the stream (`rlloom.parallel.cp.CPShard`, padded to `pad_multiple`) and
    the logprobs of the whole micro-batch are gathered on every cp rank, each rank's backward
    covering its own positions. A vision-language model's tower runs on the samples' pictures and
    the stream takes M-RoPE positions per document (`mrope.stream_positions`); a rank without
    pictures leaves the tower's gradients to FSDP2's reduction (tests/engines/train/test_train_vision.py).

    Returns logp_bT and entropy_bT (or None) on `device`, fp32 [b, T] and 0 where the response mask
    is false, then the number of tokens of the packed stream this rank computed (its share under CP;
    padding not counted) and the number of response tokens.
    Differentiable when grad is enabled. Everything the host must read (the segment structure, the
    selected positions, the counts) is computed on CPU and only the model's inputs are copied, so on
    CUDA the call queues its kernels without waiting for the GPU.
    """
    packed = batch.packed(share_prompts=share_prompts)
    num_tokens = packed.input_ids_N.numel()
    shard = None
    if cp_group is None:
        packed = pad_stream(packed, pad_multiple)
    else:
        check_cp_layout(dist.get_world_size(cp_group), packed.prefix_lens_S is not None)
        shard = CPShard(packed.cu_seqlens, group=cp_group, device=device, pad_multiple=pad_multiple)
        num_tokens = shard.num_real
    mask_bT = packed.response_mask_BT
    flat_K = mask_bT.flatten().nonzero().squeeze(1)
    if options.routing_replay and packed.routes_NLK is None:
        raise ValueError(
            "algorithm.routing_replay=rollout needs the experts the rollout chose, but a sample has no "
            "routed_experts (a dense model, or samples not made by the rollout engine). Fix: set "
            "algorithm.routing_replay=none for this model."
        )
    tree = None
    if packed.prefix_lens_S is not None and packed.branch_lens_Z is not None:
        tree = TreePlan(packed.cu_seqlens, packed.prefix_lens_S, packed.branch_lens_Z, device)
    pixels = stream_pixels(packed, module.model.args.vision)
    ids_N, routes_NLK = packed.input_ids_N, packed.routes_NLK
    pos_N = packed.position_ids_N if packed.images is None else pixels.positions_3N
    positions_K, targets_K = packed.gather_index_BT[mask_bT], packed.target_ids_BT[mask_bT]
    if shard is not None:
        mine_K, local_K = shard.localize(positions_K)
        positions_K, targets_K = local_K[mine_K], targets_K[mine_K]
        ids_N, pos_N = shard.take(ids_N), shard.take(pos_N)
        routes_NLK = None if routes_NLK is None else shard.take(routes_NLK)
    logp_K, entropy_K = module(
        to_device(ids_N, device),
        to_device(pos_N, device),
        to_device(packed.cu_seqlens, device),
        packed.max_seqlen,
        to_device(positions_K, device),
        to_device(targets_K, device),
        options,
        tree,
        None if routes_NLK is None else to_device(routes_NLK, device),
        shard,
        *pixels.on(device),
    )
    if shard is not None:
        logp_K = shard.gather_selected(logp_K, mine_K)
        entropy_K = None if entropy_K is None else shard.gather_selected(entropy_K, mine_K)
    flat_K_device = to_device(flat_K, device)

    def spread(values_K: torch.Tensor) -> torch.Tensor:
        zeros = torch.zeros(mask_bT.numel(), dtype=torch.float32, device=device)
        return zeros.index_put((flat_K_device,), values_K).view(mask_bT.shape)

    entropy_bT = spread(entropy_K) if entropy_K is not None else None
    return spread(logp_K), entropy_bT, num_tokens, flat_K.numel()


@dataclasses.dataclass(frozen=True, slots=True)
class StreamPixels:
    """A micro-batch's vision inputs for `StreamHead.forward` (all None for a text stream)."""

    pixel_values: torch.Tensor | None = None
    """[P, C*T*ps*ps] the stream's pictures."""
    grid_thw: torch.Tensor | None = None
    """[I, 3] long."""
    image_index_M: torch.Tensor | None = None
    """[M] stream rows of the image tokens (a prompt's placeholders; a generated one is text)."""
    positions_3N: torch.Tensor | None = None
    """[3, N] M-RoPE positions of the stream."""

    def on(
        self, device: torch.device
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        move = lambda x: None if x is None else to_device(x, device)
        return move(self.pixel_values), self.grid_thw, move(self.image_index_M)


def stream_pixels(packed: PackedTensors, vision: VisionArgs | None) -> StreamPixels:
    """The packed stream's pictures and M-RoPE positions (nothing for a stream without pictures)."""
    if packed.images is None:
        return StreamPixels()
    assert vision is not None, "pictures reach only vision-language models (start-up checks)"
    positions_3N, index_M = stream_positions(packed.input_ids_N, packed.position_ids_N, packed.images, vision)
    return StreamPixels(packed.images.pixel_values, packed.images.grid_thw, index_M, positions_3N)


def pad_stream(packed: PackedTensors, multiple: int) -> PackedTensors:
    """`packed` with a padding segment of token 0 appended so its length is a multiple of `multiple`
    (the same object when it already is). The segment is a causal sequence of its own (a prompt with
    no branches in the shared-prompt layout), with no recorded routes; no response reads it."""
    num_tokens = packed.input_ids_N.numel()
    pad = -num_tokens % multiple
    if pad == 0:
        return packed
    ids = packed.input_ids_N
    routes = packed.routes_NLK
    prefix = packed.prefix_lens_S
    return dataclasses.replace(
        packed,
        input_ids_N=torch.cat([ids, ids.new_zeros(pad)]),
        position_ids_N=torch.cat(
            [packed.position_ids_N, torch.arange(pad, dtype=packed.position_ids_N.dtype)]
        ),
        cu_seqlens=torch.cat([packed.cu_seqlens, packed.cu_seqlens.new_tensor([num_tokens + pad])]),
        target_ids_N=torch.cat([packed.target_ids_N, packed.target_ids_N.new_zeros(pad)]),
        max_seqlen=max(packed.max_seqlen, pad),
        prefix_lens_S=None if prefix is None else torch.cat([prefix, prefix.new_tensor([pad])]),
        routes_NLK=None
        if routes is None
        else torch.cat([routes, routes.new_full((pad, *routes.shape[1:]), -1)]),
    )
