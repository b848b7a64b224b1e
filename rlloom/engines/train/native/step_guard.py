"""Apply an optimizer step only when every new parameter would be finite.

A finite loss and gradient norm do not make a finite update: an overflowing learning rate
(`train.lr=1e39` is inf in fp32) or a degenerate AdamW state still writes inf/NaN weights, which
would be synced to the rollout and saved. So before each step the engine runs the same fused AdamW
update on copies, one slice of at most `TRIAL_CHUNK` elements of one parameter at a time, checks the
results, and applies the real step only when every value on every rank is finite; otherwise
nothing changes (parameters, master copies and optimizer state stay as they were: the step is
rolled back before it happens).

Why a trial instead of a snapshot: AdamW is elementwise, so a slice's trial computes exactly the
values the real step will write there, and the trial needs temporary memory for one slice
(~13 bytes an element) instead of a copy of every parameter and both moments (12-16 bytes a
parameter, on the GPU, at every step). It costs one more pass of the optimizer's arithmetic.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw

TRIAL_CHUNK = 1 << 24
"""Elements per trial slice (16M: ~208 MB of temporaries for fp32 parameters)."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def adamw_would_be_finite(optim: torch.optim.Optimizer) -> torch.Tensor:
    """A bool scalar on the parameters' device: True when `optim.step()` (a fused AdamW) would leave
    every parameter that has a gradient finite. Changes nothing."""
    flags = []
    for group in optim.param_groups:
        beta1, beta2 = group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state: dict[str, Any] = optim.state.get(p, {})
            param, grad = _local(p.detach()).reshape(-1), _local(p.grad).reshape(-1)
            m = _local(state["exp_avg"]).reshape(-1) if state else None
            v = _local(state["exp_avg_sq"]).reshape(-1) if state else None
            step = state["step"] if state else torch.zeros((), dtype=torch.float32, device=param.device)
            for lo in range(0, param.numel(), TRIAL_CHUNK):
                hi = min(lo + TRIAL_CHUNK, param.numel())
                trial = param[lo:hi].clone()
                adamw(
                    [trial],
                    [grad[lo:hi]],
                    [m[lo:hi].clone() if m is not None else torch.zeros_like(trial)],
                    [v[lo:hi].clone() if v is not None else torch.zeros_like(trial)],
                    [],
                    [step.clone()],
                    fused=True,
                    amsgrad=False,
                    beta1=beta1,
                    beta2=beta2,
                    lr=group["lr"],
                    weight_decay=group["weight_decay"],
                    eps=group["eps"],
                    maximize=False,
                )
                flags.append(torch.isfinite(trial).all())
    if not flags:
        return torch.tensor(True)
    return torch.stack(flags).all()


def optimizer_state_tensors(optimizers: list[torch.optim.Optimizer]) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the optimizers' state, named by optimizer, row and key."""
    out = []
    for i, optim in enumerate(optimizers):
        for j, state in enumerate(optim.state.values()):
            out += [
                (f"optimizer{i}.state{j}.{k}", v) for k, v in state.items() if isinstance(v, torch.Tensor)
            ]
    return out


@torch.no_grad()
def all_true(flags: list[torch.Tensor], group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """True when every flag is true on every rank of `group` (one host read)."""
    ok = torch.stack([f.to(device) for f in flags]).all() if flags else torch.tensor(True, device=device)
    if group is not None and dist.get_world_size(group) > 1:
        comm = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
        bad = (~ok).to(device=comm, dtype=torch.int32)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
        return not bool(bad.item())
    return bool(ok.item())


@torch.no_grad()
def all_finite(tensors: list[torch.Tensor], group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """True when every value of every tensor (this rank's shard of a DTensor) is finite on every rank
    of `group` (one host read)."""
    return all_true([torch.isfinite(_local(t.detach())).all() for t in tensors if t.numel()], group, device)
