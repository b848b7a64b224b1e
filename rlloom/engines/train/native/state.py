"""The training engine's state on disk and across devices: save and load through checkpoint.py
(model, both optimizer halves, the engine's counters), the refusal to save non-finite tensors, and
the move of parameters and optimizer state to the CPU and back (offload / onload)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from rlloom.engines.train.native.checkpoint import load_checkpoint, save_checkpoint
from rlloom.engines.train.native.layout import EngineLayout
from rlloom.engines.train.native.optimizer import EngineOptimizer
from rlloom.engines.train.native.step_guard import all_finite, optimizer_state_tensors


def save_state(
    path: str,
    module: nn.Module,
    optimizer: EngineOptimizer,
    state: dict[str, Any],
    *,
    layout: EngineLayout,
    device: torch.device,
) -> None:
    """Write `module`, `optimizer` and the small `state` to the folder `path` (all ranks)."""
    check_finite_for_save(path, module, optimizer, layout=layout, device=device)
    save_checkpoint(
        path,
        module,
        _dcp_optimizers(optimizer),
        optimizer.offloaded_state_dict(),
        state,
        experts=(layout.ep_rank, layout.ep),
    )


def load_state(
    path: str, module: nn.Module, optimizer: EngineOptimizer, *, layout: EngineLayout
) -> dict[str, Any]:
    """Restore a `save_state`d folder into `module` and `optimizer`; return the small state."""
    state, extra = load_checkpoint(
        path,
        module,
        _dcp_optimizers(optimizer),
        optimizer.offloaded_state_dict(),
        experts=(layout.ep_rank, layout.ep),
    )
    optimizer.load_offloaded_state_dict(extra)
    optimizer.guard.forget()  # parameters and moments were written: the guard reads them again
    return state


def _dcp_optimizers(optimizer: EngineOptimizer) -> list[torch.optim.Optimizer]:
    optim = optimizer.device_optim
    return [optim] if optim is not None else []


def check_finite_for_save(
    path: str, module: nn.Module, optimizer: EngineOptimizer, *, layout: EngineLayout, device: torch.device
) -> None:
    """Refuse (on every rank alike) to write parameters or optimizer state holding inf or NaN."""
    named = list(module.named_parameters()) + list(optimizer_state_tensors(optimizer.optimizers))
    if all_finite([t for _, t in named], layout.world_group, device):
        return
    local = [name for name, t in named if not all_finite([t], None, device)]
    raise ValueError(
        f"refusing to save a checkpoint to {path!r}: tensors are not finite (on rank {layout.dp_rank}: "
        f"{', '.join(local[:3]) or 'none; another rank'}{' ...' if len(local) > 3 else ''}), so it would "
        "not be resumable. Fix: resume from an earlier checkpoint and lower train.lr."
    )


def move_state(
    modules: Sequence[nn.Module], optimizer: EngineOptimizer | None, to: torch.device, device: torch.device
) -> None:
    """Move the parameters of `modules`, their gradients and the device optimizer's state to `to`
    (`device`: the engine's own, synchronised on CUDA)."""
    for module in modules:
        module.to(to)  # FSDP2 keeps its sharded parameters registered across .to()
    if optimizer is not None:
        optimizer.move_state(to)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
