"""Pipeline micro-batches: what the caller packs (`PipeMicroBatch`), the same padded to the one
token budget every micro-batch has (`pad_to_budget`: pipelining fixes activation shapes when it
first runs, so every micro-batch is the packed stream plus one padding segment, attending only to
itself, up to the budget; under context parallelism each cp rank keeps an equal share of it,
budget / cp tokens, `cp.fixed_shares`), and what the stages of one schedule step read (`StageFeed`).

Shape legend: N tokens of a micro-batch, P the token budget, K selected positions, k of them held
by this cp rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from rlloom.models.attention_ops import AttnLayout, TreePlan
from rlloom.parallel.cp import CPShard, check_cp_layout, fixed_shares


@dataclass
class PipeMicroBatch:
    """One micro-batch as the caller packed it (unpadded; CPU or device tensors)."""

    input_ids_N: torch.Tensor
    position_ids_N: torch.Tensor
    cu_seqlens: torch.Tensor
    """[S + 1] int32."""
    max_seqlen: int
    positions_K: torch.Tensor
    """[K] int64 positions whose next token is scored."""
    targets_K: torch.Tensor
    """[K] int64 the scored tokens."""
    prefix_lens_S: torch.Tensor | None = None
    """Shared-prompt layout (as `PackedTensors`): [S] prompt length opening each segment, or None."""
    branch_lens_Z: torch.Tensor | None = None
    """Shared-prompt layout: [Z] non-empty branch lengths in stream order, or None."""
    routes_NLK: torch.Tensor | None = None
    """[N, MoE layers, K] experts the rollout chose per position (-1 = none), or None."""


@dataclass
class PaddedMicroBatch:
    """A micro-batch padded to the budget, on the device: one padding segment after the real tokens."""

    input_ids_1P: torch.Tensor
    position_ids_P: torch.Tensor
    layout: AttnLayout
    positions_K: torch.Tensor
    targets_K: torch.Tensor
    routes_PLK: torch.Tensor | None
    real: bool
    cp: CPShard | None = None
    """Context parallelism: this rank's share of the padded stream (budget / cp tokens); the ids,
    positions and routes above are then this rank's rows, the attention is the shard's, and
    positions_K/targets_K stay the whole micro-batch's."""
    mine_K: torch.Tensor | None = None
    """Under CP: [K] bool, the selected positions this rank holds (k of them)."""
    local_k: torch.Tensor | None = None
    """Under CP: [k] those positions in this rank's tokens (selected on the host: no device sync)."""
    local_targets_k: torch.Tensor | None = None
    """Under CP: [k] their target tokens."""
    padding_L: torch.Tensor | None = None
    """[L] bool over the rows this rank runs (the budget, or its CP share): the padding's, which the
    MoE loads must not count."""


def pad_to_budget(
    mb: PipeMicroBatch | None, budget: int, device: torch.device, cp_group: dist.ProcessGroup | None = None
) -> PaddedMicroBatch:
    """`mb` padded with a segment of its own up to `budget` tokens; None gives an all-padding filler.
    With `cp_group` (context parallelism) the padded stream is cut into equal shares
    (`cp.fixed_shares`) and this rank keeps its own."""
    if mb is None:
        empty = torch.zeros(0, dtype=torch.int64)
        mb = PipeMicroBatch(empty, empty, torch.zeros(1, dtype=torch.int32), 0, empty, empty)
    n = mb.input_ids_N.numel()
    if n > budget:
        raise ValueError(
            f"a micro-batch has {n} tokens but train.max_tokens_per_micro_batch={budget}; under pipeline "
            "parallelism every micro-batch is padded to that budget, so no sample may exceed it. Fix: raise "
            f"train.max_tokens_per_micro_batch to at least {n} (the longest prompt + response)."
        )
    pad = budget - n
    ids = torch.cat([mb.input_ids_N.cpu(), torch.zeros(pad, dtype=torch.int64)])
    pos = torch.cat([mb.position_ids_N.cpu(), torch.arange(pad)])
    cu = mb.cu_seqlens.cpu().to(torch.int32)
    prefix = mb.prefix_lens_S
    routes = mb.routes_NLK
    if pad:  # the padding segment: a causal sequence of its own (a prompt without branches)
        cu = torch.cat([cu, torch.tensor([budget], dtype=torch.int32)])
        prefix = None if prefix is None else torch.cat([prefix.cpu(), prefix.new_tensor([pad]).cpu()])
        routes = (
            None if routes is None else torch.cat([routes, routes.new_full((pad, *routes.shape[1:]), -1)])
        )
    layout = AttnLayout(kind="packed", cu_seqlens=cu.to(device), max_seqlen=max(mb.max_seqlen, pad))
    if prefix is not None and mb.branch_lens_Z is not None:
        tree = TreePlan(cu, prefix, mb.branch_lens_Z.cpu(), device)  # built on the host: no syncs
        if tree.has_branches:
            layout = AttnLayout(
                kind="tree", cu_seqlens=layout.cu_seqlens, max_seqlen=layout.max_seqlen, tree=tree
            )
    if cp_group is None:
        return PaddedMicroBatch(
            ids.view(1, budget).to(device),
            pos.to(device),
            layout,
            mb.positions_K.to(device),
            mb.targets_K.to(device),
            None if routes is None else routes.to(device),
            real=n > 0,
            padding_L=(torch.arange(budget) >= n).to(device),
        )
    check_cp_layout(dist.get_world_size(cp_group), prefix is not None)
    lens = (cu[1:] - cu[:-1]).tolist()
    shares = fixed_shares(lens, dist.get_world_size(cp_group), padded=pad > 0)
    shard = CPShard(cu, group=cp_group, device=device, shares=shares)
    mine_K, local_K = shard.localize(mb.positions_K.cpu())
    targets_K = mb.targets_K.cpu()
    return PaddedMicroBatch(
        shard.take(ids).view(1, -1).to(device),
        shard.take(pos).to(device),
        AttnLayout(kind="backend", backend=shard),
        mb.positions_K.to(device),
        mb.targets_K.to(device),
        None if routes is None else shard.take(routes).to(device),
        real=n > 0,
        cp=shard,
        mine_K=mine_K.to(device),
        local_k=local_K[mine_K].to(device),
        local_targets_k=targets_K[mine_K].to(device),
        padding_L=(shard.take(torch.arange(budget)) >= n).to(device),
    )


@dataclass
class StageFeed:
    """What the stages of one schedule step read: the padded micro-batches and the head's settings."""

    micro_batches: list[PaddedMicroBatch] = field(default_factory=list)
    temperature: float = 1.0
    with_entropy: bool = False
    replay_routes: bool = False
    """MoE: use the micro-batches' routes (routing replay) instead of only comparing them."""
    moe_loads: dict[str, torch.Tensor] | None = None
    """When a dict: each stage adds, per MoE layer key, the [E] real tokens its forwards routed to
    each expert (the training engine's MoE load metrics and bias update); None: not recorded."""
    route_counts_M2: torch.Tensor | None = None
    """When a tensor [M, 2]: each stage adds, per micro-batch, its MoE layers' (differing, compared)
    token counts against the rollout's routes (`MoE.last_route_mismatch`); None: not recorded."""
    tp_rank: int = 0
    """This rank's TP index: which token shard its MoE layers route when each TP rank routes its own."""
    aux_loss_sum: torch.Tensor | None = None
    """When a tensor (a scalar): the MoE auxiliary loss is on (`pp_aux.py`); each stage adds, per
    real micro-batch, sum over its MoE layers of (the layer's loss over the real tokens) x (those
    tokens) x `aux_token_weight`: this rank's layers' part of moe/aux_loss. None: off."""
    aux_token_weight: float = 0.0
    """1 / (the whole model's MoE layers x the tokens of the global batch): a micro-batch's token
    share and the mean over layers, as the one-process engine weighs each layer's loss."""
    aux_loss_coef: float = 0.0
    """train.moe_aux_loss_coef: the factor between that weighted loss and what is back-propagated."""
    token_groups: tuple[dist.ProcessGroup, ...] = ()
    """The groups of ranks that split each micro-batch's tokens between their MoE layers (CP, and
    TP when each TP rank routes its own shard): the auxiliary loss sums its expert counts over them."""


def check_budget(budget: int, shares: int) -> None:
    """ValueError unless the micro-batch token budget splits into `shares` (cp x tp) equal token shares."""
    if budget < 1 or budget % shares:
        raise ValueError(
            f"train.max_tokens_per_micro_batch={budget} is invalid with parallel.pp > 1: every micro-batch is "
            f"padded to this budget and split into parallel.cp x parallel.tp = {shares} equal token shares, so it "
            f"must be a positive multiple of {shares}. Fix: set it to {max(shares, -(-budget // shares) * shares)}."
        )
