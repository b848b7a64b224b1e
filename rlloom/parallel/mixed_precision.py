"""Mixed precision on one device without FSDP: `ComputeCopies`.

Across ranks FSDP2 shards the fp32 master parameters, casts them to the compute dtype for each
forward and reduces the gradients in fp32 (fsdp.py). One device has nothing to shard or reduce, yet
FSDP at world size 1 still moves every gradient through its reduce (a concatenation, a copy, the
copy into the sharded gradient) and accumulates micro-batches with torch's mixed-dtype add, which
runs at about half the memory bandwidth: about 150 ms of a 1.1 s step of a 5.6B-parameter MoE on one
H200 (docs/benchmarks.md). So one device runs without FSDP (unless the run offloads its optimizer
to save GPU memory: then FSDP's copies, one layer at a time, are worth its slower step; the rule is
`NativeTrainEngine`'s):

- the module keeps its fp32 master parameters (the optimizer, clipping, the step guard, checkpoints
  and weight export see them, with fp32 gradients, as in the one-process fp32 path);
- `computing()` puts a compute-dtype copy of each parameter in its place, cast once for however
  many micro-batches run inside it, and puts the masters back (the copies' memory freed) on exit;
- when autograd has a copy's gradient, a hook adds it into its master's fp32 `.grad` (the first
  one is cast into place) and frees it: one pass at the memory bound, a Triton kernel on CUDA
  (`accumulate_kernel.py`), bit for bit torch's fp32 + bf16 add.

The numbers equal FSDP's at world size 1: the same bf16 copies, the same bf16 gradients, summed in
fp32 in the same order (tests/parallel/test_mixed_precision.py checks parameters after training
steps bit for bit). A parameter shared by several modules (a tied head) gets one copy.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch import nn


def accumulate_grad_(master: nn.Parameter, grad: torch.Tensor) -> None:
    """master.grad (fp32) += grad (any float dtype); the first call casts `grad` into place."""
    fast = grad.is_cuda and grad.is_contiguous() and master.is_contiguous() and grad.numel() == master.numel()
    if fast:
        from rlloom.parallel import accumulate_kernel  # Triton: imported where it runs (CUDA)

        if master.grad is None:
            master.grad = torch.empty_like(master, memory_format=torch.contiguous_format)
            accumulate_kernel.accumulate_(master.grad, grad, add=False)
        else:
            accumulate_kernel.accumulate_(master.grad, grad, add=True)
        return
    if master.grad is None:
        master.grad = grad.to(master.dtype, memory_format=torch.contiguous_format)
    else:
        master.grad.add_(grad)


def _take_grad(master: nn.Parameter, copy: nn.Parameter) -> None:
    """The copy's post-accumulate-grad hook: move its gradient into the master's, free it."""
    grad, copy.grad = copy.grad, None
    if grad is not None:
        accumulate_grad_(master, grad)


class ComputeCopies:
    """Compute-dtype stand-ins for the fp32 master parameters of `module` (see the module docstring)."""

    def __init__(self, module: nn.Module, dtype: torch.dtype) -> None:
        self.dtype = dtype
        slots: dict[int, list[tuple[nn.Module, str]]] = {}
        masters: dict[int, nn.Parameter] = {}
        for owner in module.modules():
            for name, p in owner._parameters.items():
                if p is not None:
                    slots.setdefault(id(p), []).append((owner, name))
                    masters[id(p)] = p
        self._entries: list[tuple[nn.Parameter, nn.Parameter, list[tuple[nn.Module, str]]]] = []
        for key, master in masters.items():
            if master.dtype == dtype:
                continue  # already in the compute dtype: used as it is
            # One Parameter object per master for the whole run (its storage set on each entry):
            # compiled layers see the same inputs every step.
            copy = nn.Parameter(
                torch.empty(0, dtype=dtype, device=master.device), requires_grad=master.requires_grad
            )
            if master.requires_grad:
                copy.register_post_accumulate_grad_hook(functools.partial(_take_grad, master))
            self._entries.append((master, copy, slots[key]))

    @contextlib.contextmanager
    def computing(self) -> Iterator[None]:
        """Run the forward and backward passes inside: the copies stand in for the masters, and
        their gradients end up in the masters' `.grad` (accumulated over everything run inside)."""
        with torch.no_grad():
            for master, copy, slots in self._entries:
                copy.data = master.detach().to(self.dtype)
                for owner, name in slots:
                    owner._parameters[name] = copy
        try:
            yield
        finally:
            for master, copy, slots in self._entries:
                for owner, name in slots:
                    owner._parameters[name] = master
                copy.data = copy.data.new_empty(0)
                copy.grad = None
