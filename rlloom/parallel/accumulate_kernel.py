"""Triton kernel of `mixed_precision.accumulate_grad_` on CUDA: acc (fp32) = acc + grad, or the cast
of grad, in one pass. torch's own fp32 += bf16 add runs an unvectorised mixed-dtype loop at about
half the memory bandwidth of an H200 (docs/benchmarks.md); this computes the same fp32 sum."""

# Triton reads a kernel's annotations as specialisation hints, so its pointer arguments stay bare.
# ruff: noqa: ANN001

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _accumulate_kernel(acc_ptr, grad_ptr, n, ADD: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < n
    x = tl.load(grad_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    if ADD:
        x += tl.load(acc_ptr + offs, mask=valid, other=0.0)
    tl.store(acc_ptr + offs, x, mask=valid)


def accumulate_(acc: torch.Tensor, grad: torch.Tensor, *, add: bool) -> None:
    """acc (fp32, contiguous) = acc + grad (add) or grad cast to fp32 (contiguous, acc's numel)."""
    n = acc.numel()
    if n == 0:
        return
    _accumulate_kernel[(triton.cdiv(n, BLOCK),)](acc, grad, n, ADD=add, BLOCK=BLOCK, num_warps=8)
