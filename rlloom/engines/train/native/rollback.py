"""Roll back an optimizer step whose new parameters are not finite.

A finite loss and gradient norm do not make a finite update: an overflowing learning rate
(`train.lr=1e39` is inf in fp32) or a degenerate AdamW state still writes inf/NaN weights, which
would be synced to the rollout and saved. So the engine snapshots the parameters and the optimizer
state (both halves of an offloaded optimizer, and its CPU master copies) before each step, checks
the new parameters on every rank, and restores the snapshot when any value is not finite.

The snapshot costs one copy of this rank's parameter shards and optimizer state per step, in the
memory they live in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from rlloom.engines.train.native.optimizer import EngineOptimizer


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass(kw_only=True, slots=True)
class StepSnapshot:
    """Copies of what one optimizer step changes."""

    params: list[torch.Tensor]
    """This rank's shard of every parameter, in `EngineOptimizer.params` order."""
    masters: list[torch.Tensor]
    """The CPU master copies of offloaded parameters, in `EngineOptimizer.offloaded` order."""
    states: list[dict[Any, dict[str, Any]]]
    """Per optimizer (`EngineOptimizer.optimizers` order): parameter -> its AdamW state (empty before
    the first step)."""


def _copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


@torch.no_grad()
def take_snapshot(optimizer: EngineOptimizer) -> StepSnapshot:
    return StepSnapshot(
        params=[_local(p.detach()).clone() for p in optimizer.params],
        masters=[master.detach().clone() for _, _, master in optimizer.offloaded],
        states=[
            {p: {k: _copy(v) for k, v in state.items()} for p, state in optim.state.items()}
            for optim in optimizer.optimizers
        ],
    )


@torch.no_grad()
def restore_snapshot(optimizer: EngineOptimizer, snapshot: StepSnapshot) -> None:
    """Put the parameters and the optimizer state back as they were when `snapshot` was taken."""
    for p, saved in zip(optimizer.params, snapshot.params, strict=True):
        _local(p.detach()).copy_(saved)
    for (_, _, master), saved in zip(optimizer.offloaded, snapshot.masters, strict=True):
        master.detach().copy_(saved)
    for optim, states in zip(optimizer.optimizers, snapshot.states, strict=True):
        optim.state.clear()  # parameters without state before the step (the first step) get none
        optim.state.update(states)


def optimizer_state_tensors(optimizer: EngineOptimizer) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the optimizer state, named by optimizer, group row and key."""
    out = []
    for i, optim in enumerate(optimizer.optimizers):
        for j, state in enumerate(optim.state.values()):
            out += [
                (f"optimizer{i}.state{j}.{k}", v) for k, v in state.items() if isinstance(v, torch.Tensor)
            ]
    return out


@torch.no_grad()
def all_finite(tensors: list[torch.Tensor], group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """True when every value of every tensor (this rank's shard of a DTensor) is finite on every rank
    of `group` (one host read)."""
    local = [_local(t.detach()) for t in tensors]
    flags = [torch.isfinite(t).all() for t in local if t.numel()]
    ok = torch.stack(flags).all() if flags else torch.tensor(True, device=device)
    if group is not None and dist.get_world_size(group) > 1:
        comm = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
        bad = (~ok).to(device=comm, dtype=torch.int32)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
        return not bool(bad.item())
    return bool(ok.item())
