"""The training engine's plan of one global batch: this data-parallel rank's micro-batches.

Every rank receives the same global batch and computes the same plan from it (microbatch.py's pure
index arithmetic), so no plan is sent; one tiny all-reduce first checks that the batches agree, as
a rank with another batch would plan other collectives and hang. With `share_prompts` the packing
units are groups (one prompt copy + its responses).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlloom.config import TrainEngineConfig
from rlloom.data.types import RolloutBatch
from rlloom.engines.train.native.layout import EngineLayout
from rlloom.engines.train.native.microbatch import plan_rank, shared_prompt_units


def plan_batch(
    batch: RolloutBatch, cfg: TrainEngineConfig, layout: EngineLayout, device: torch.device
) -> tuple[list[list[int] | None], int]:
    """This rank's micro-batches (None = a zero-weight filler) and the filler's sample index."""
    check_same_batch(batch, layout, device)
    budget = cfg.max_tokens_per_micro_batch
    if not cfg.share_prompts:
        num_tokens = [s.num_tokens for s in batch.samples]
        return plan_rank(num_tokens, rank=layout.dp_rank, num_ranks=layout.dp_size, max_tokens=budget)
    units, unit_tokens = _shared_prompt_units(batch, budget)
    return plan_rank(
        unit_tokens, rank=layout.dp_rank, num_ranks=layout.dp_size, max_tokens=budget, units=units
    )


def check_same_batch(batch: RolloutBatch, layout: EngineLayout, device: torch.device) -> None:
    """Raise on every rank when the ranks received different batches (one all-reduce)."""
    if layout.world_size == 1:
        return
    local = torch.tensor(
        [len(batch), batch.num_tokens, batch.T], dtype=torch.float64, device=layout.comm_device(device)
    )
    both = torch.cat([local, -local])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=layout.world_group)
    if not torch.equal(both[:3], -both[3:]):
        raise ValueError(
            f"ranks received different batches (samples, tokens, T): rank {dist.get_rank()} has "
            f"{local.long().tolist()}, the max over ranks is {both[:3].long().tolist()}. Fix: pass every rank "
            "the same global batch; the engine picks each rank's share itself."
        )


def computed_tokens(batch: RolloutBatch, cfg: TrainEngineConfig) -> int:
    """Tokens the forward passes over the whole global batch (prompts once per group when shared)."""
    if not cfg.share_prompts:
        return batch.num_tokens
    return sum(_shared_prompt_units(batch, cfg.max_tokens_per_micro_batch)[1])


def _shared_prompt_units(batch: RolloutBatch, budget: int) -> tuple[list[list[int]], list[int]]:
    return shared_prompt_units(
        batch.shared_prompt_groups(),
        [len(s.prompt_ids) for s in batch.samples],
        [len(s.response_ids) for s in batch.samples],
        budget,
    )
