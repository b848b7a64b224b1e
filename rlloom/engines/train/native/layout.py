"""`EngineLayout`: what the training engine needs to know of its parallel layout, and nothing more.

The engine plans micro-batches per data-parallel rank (the TP and CP ranks of one dp rank run the
SAME micro-batches, as they hold the same samples; CP ranks each compute a share of the tokens and
gather the micro-batch's logprobs), reduces metrics and per-row results over the dp ranks only,
pads each packed stream (each CP share) to a multiple of tp, and takes decisions that must agree on
every rank (skip a step, refuse a save) over the whole world. Everything else about the layout
lives in `rlloom.parallel` (`parallelize` and the meshes of `ParallelDims`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlloom.parallel.dims import ParallelDims


@dataclass(frozen=True, slots=True)
class EngineLayout:
    dp_group: dist.ProcessGroup | None = None
    """Data-parallel ranks (dp_replicate x dp_shard); None in one unsharded process."""
    dp_rank: int = 0
    dp_size: int = 1
    tp: int = 1
    """Tensor-parallel degree: packed streams are padded to a multiple of it."""
    tp_group: dist.ProcessGroup | None = None
    tp_rank: int = 0
    """This rank's place in its TP group (which token shard it routes when `tokens_split_over_tp`)."""
    cp: int = 1
    """Context-parallel degree: the cp ranks of one dp rank run the same micro-batches, each on its
    share of every packed stream (`rlloom.parallel.cp`)."""
    cp_group: dist.ProcessGroup | None = None
    ep: int = 1
    ep_rank: int = 0
    ep_group: dist.ProcessGroup | None = None
    """Expert-parallel ranks (None without expert parallelism)."""
    world_group: dist.ProcessGroup | None = None
    """Every rank: decisions that must be the same everywhere (a skipped step, a refused save)."""
    world_size: int = 1
    moe_count_group: dist.ProcessGroup | None = None
    """Ranks whose MoE token counts add up to the global batch's: dp x cp, or dp x cp x tp when each
    TP rank routes only its own token shard (expert parallelism over the TP ranks)."""
    tokens_split_over_tp: bool = False
    """Each TP rank routes its own token shard through the MoE layers (ep > 1 and tp > 1)."""

    def token_groups(self) -> tuple[dist.ProcessGroup, ...]:
        """The groups of ranks that split a micro-batch's tokens between their MoE layers: the TP
        ranks when each routes its own shard, the CP ranks (the MoE auxiliary loss sums its expert
        counts over them, and moe/aux_loss its parts)."""
        groups = (self.tp_group,) if self.tokens_split_over_tp else ()
        return groups + ((self.cp_group,) if self.cp > 1 else ())

    def summed_over_token_groups(self, value: torch.Tensor, device: torch.device) -> torch.Tensor:
        """`value` (a sum over what this rank's MoE layers routed) summed over `token_groups()`, on
        `device`."""
        groups = self.token_groups()
        if groups:
            value = value.to(self.comm_device(device))
        for group in groups:
            dist.all_reduce(value, group=group)
        return value.to(device)

    def comm_device(self, device: torch.device) -> torch.device:
        """Where the tensors of this layout's collectives live: `device` under NCCL, else the CPU."""
        return device if dist.get_backend(self.world_group) == "nccl" else torch.device("cpu")

    @classmethod
    def of(cls, dims: ParallelDims | None) -> EngineLayout:
        if dims is None:
            return cls()
        dp = dims.dp_mesh()
        split = dims.ep > 1 and dims.tp > 1
        return cls(
            dp_group=dp.get_group(),
            dp_rank=dp.get_local_rank(),
            dp_size=dp.size(),
            tp=dims.tp,
            tp_group=dims.tp_mesh().get_group(),
            tp_rank=dims.tp_mesh().get_local_rank(),
            cp=dims.cp,
            cp_group=dims.cp_mesh().get_group(),
            ep=dims.ep,
            ep_rank=dims.ep_mesh().get_local_rank(),
            ep_group=dims.ep_mesh().get_group() if dims.ep > 1 else None,
            world_group=dist.group.WORLD,
            world_size=dims.world_size,
            moe_count_group=(dims.token_mesh() if split else dims.loss_mesh()).get_group(),
            tokens_split_over_tp=split,
        )
