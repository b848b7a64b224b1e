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
parameter, on the GPU, at every step).

The trial is the fallback, because it costs more memory traffic than the step itself (copies of
the parameter and both moments, the update, the check: about 18% of a Qwen3-30B-A3B-width train
step on one H200). First comes a bound: from the largest |parameter|, |gradient|, |exp_avg| and
exp_avg_sq of a parameter group and the group's scalars, `_next_maxima` bounds every intermediate
value of the fused AdamW update. When every bound is finite and below `BOUND_LIMIT` (2^-10 of the
fp32 maximum, so no rounding reaches inf) and eps > 0 (no 0/0), the step is certainly finite and
the trial is skipped: every ordinary step. Otherwise (an overflowing learning rate, eps = 0, betas
outside [0, 1), a non-finite value anywhere) the exact trial decides. The bound is sufficient,
never necessary, so the guard's answer is always the trial's. On the CPU half of an offloaded
optimizer this also spares a second CPU AdamW pass.

The maxima need not be read at every step (one read of every parameter, gradient and moment: on
a 5.6B-parameter MoE at 16k tokens a step, about 6% of it). `StepGuard` carries them: the global
gradient norm bounds |gradient| (the caller has it), and the same bound that certifies a step
also bounds |p|, |m| and v after it, so the next step starts from those. They are read again only
when the carried ones no longer certify a step, when the group's parameters with a gradient
change, and after a checkpoint is loaded (`forget`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw

TRIAL_CHUNK = 1 << 24
"""Elements per trial slice (16M: ~208 MB of temporaries for fp32 parameters)."""
BOUND_LIMIT = torch.finfo(torch.float32).max / 2**10
"""Largest bound `_next_maxima` accepts for any intermediate value of the update."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


SLACK = 1.0 + 2.0**-10
"""Relative margin on carried bounds and on the gradient norm (covers their fp32 rounding)."""

Maxima = tuple[float, float, float]
"""Upper bounds on a parameter group's largest |parameter|, |exp_avg| and exp_avg_sq."""


class StepGuard:
    """Certifies each fused AdamW step finite before it is applied (module docstring), carrying each
    parameter group's maxima from one applied step to the next.

    Per step: `would_be_finite` for each optimizer, then `settle(applied)` once the caller knows
    whether the step was applied (on every rank). `forget` after anything but the optimizer step
    writes parameters or optimizer state (a checkpoint load).
    """

    def __init__(self) -> None:
        self._carried: dict[tuple[int, int], tuple[tuple[int, ...], Maxima]] = {}
        self._pending: dict[tuple[int, int], tuple[tuple[int, ...], Maxima] | None] = {}

    @torch.no_grad()
    def would_be_finite(self, optim: torch.optim.Optimizer, *, grad_max: float | None = None) -> torch.Tensor:
        """A bool scalar: True when `optim.step()` (a fused AdamW) would leave every parameter that
        has a gradient finite. Changes nothing. `grad_max` bounds every |gradient| (the global
        gradient norm after clipping); None reads the gradients' maxima."""
        flags = []
        for j, group in enumerate(optim.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            key, ids = (id(optim), j), tuple(id(p) for p in params)
            carried = self._carried.get(key)
            nxt = None
            if carried is not None and carried[0] == ids and grad_max is not None:
                P, M, V = carried[1]
                nxt = _next_maxima(group, P, grad_max, M, V)
            if nxt is None:
                P, G, M, V = _group_maxima(optim, params, grads=grad_max is None)
                nxt = _next_maxima(group, P, G if grad_max is None else grad_max, M, V)
            if nxt is None:
                flags.append(_trial(optim, group))
            self._pending[key] = None if nxt is None else (ids, nxt)
        if not flags:
            return torch.tensor(True)
        return torch.stack(flags).all()

    def settle(self, applied: bool) -> None:
        """After the step: an applied one hands its bounds on to the next step (a trial's step
        leaves none); a step not applied changed nothing, so the carried bounds still hold."""
        if applied:
            for key, value in self._pending.items():
                if value is None:
                    self._carried.pop(key, None)
                else:
                    self._carried[key] = value
        self._pending.clear()

    def forget(self) -> None:
        """Read the maxima again at the next step (the parameters or moments were written)."""
        self._carried.clear()
        self._pending.clear()


def _max_abs(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """max |x| over every element of `tensors` (this rank's shards; NaN if any is NaN), 0-d fp32 on
    `device` (0 when there are none). On CUDA one multi-tensor inf-norm; on the CPU, whose foreach
    inf-norm is a slow scalar loop (~2.5 GB/s on 2 cores, 9x a fused CPU AdamW step), each tensor's
    `aminmax` (vectorised, multi-threaded: ~10x faster)."""
    # a DTensor smaller than its mesh (a critic's one-element value-head bias) has empty shards
    tensors = [local for t in tensors if (local := _local(t).detach()).numel()]
    if not tensors:
        return torch.zeros((), device=device)
    if tensors[0].device.type == "cuda":
        norms = torch._foreach_norm(tensors, ord=float("inf"))
    else:
        norms = [torch.stack(torch.aminmax(t)).abs().max() for t in tensors]  # NaN stays NaN
    return torch.stack([n.float() for n in norms]).max().to(device)


def _group_maxima(
    optim: torch.optim.Optimizer, params: list[torch.Tensor], *, grads: bool
) -> tuple[float, float, float, float]:
    """The largest |p|, |g| (0 unless `grads`), |m| and v of `params`: one host read."""
    states = [optim.state.get(p, {}) for p in params]
    device = _local(params[0].detach()).device
    maxima = torch.stack(
        [
            _max_abs(params, device),
            _max_abs([p.grad for p in params] if grads else [], device),
            _max_abs([s["exp_avg"] for s in states if s], device),
            _max_abs([s["exp_avg_sq"] for s in states if s], device),
        ]
    )
    P, G, M, V = maxima.double().tolist()
    return P, G, M, V


def _next_maxima(group: dict[str, Any], P: float, G: float, M: float, V: float) -> Maxima | None:
    """Bounds on |p|, |m| and v after this group's fused AdamW step (no amsgrad, not maximising),
    when a bound on every intermediate value of the step is finite and below BOUND_LIMIT (so the
    step cannot write inf or NaN); None otherwise. P, G, M, V bound the largest |p|, |g|, |m| and v.

    With step size s = lr / (1 - beta1^t) <= lr / (1 - beta1) and the kernel's order of operations
    (p -= lr*wd*p; m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g*g; denom = sqrt(v) / sqrt(1 - b2^t) +
    eps >= eps; p -= s*m / denom), every |value| stays under: lr*wd, P*|1 - lr*wd|, M1 = b1*M +
    (1-b1)*G, V1 = b2*V + (1-b2)*G^2, s*M1, s*M1/eps and their sum; the new |p|, |m| and v under
    P*|1 - lr*wd| + s*M1/eps, M1 and V1 (with SLACK for their rounding)."""
    lr, wd, eps = (float(group[k]) for k in ("lr", "weight_decay", "eps"))
    beta1, beta2 = (float(b) for b in group["betas"])
    if group.get("amsgrad") or group.get("maximize"):
        return None
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0 and eps >= torch.finfo(torch.float32).tiny):
        return None
    step_size = lr / (1.0 - beta1)
    m1 = beta1 * M + (1.0 - beta1) * G
    v1 = beta2 * V + (1.0 - beta2) * G * G
    decay = abs(lr * wd)
    decayed = P * abs(1.0 - lr * wd)
    update = step_size * m1 / eps
    bounds = (
        *(abs(lr), decay, decay * P, decayed),  # the decoupled weight decay
        *(m1, G * G, v1, math.sqrt(v1 / (1.0 - beta2))),  # the moments and sqrt(v_hat)
        *(step_size, step_size * m1, m1 / eps, update, decayed + update),  # the step
    )
    if not all(math.isfinite(b) and b < BOUND_LIMIT for b in bounds):
        return None
    return (decayed + update) * SLACK, m1 * SLACK, v1 * SLACK


def _trial(optim: torch.optim.Optimizer, group: dict[str, Any]) -> torch.Tensor:
    """The exact check: the same fused AdamW update on copies, one slice at a time; a bool scalar on
    the parameters' device."""
    flags = []
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
