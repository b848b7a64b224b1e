"""Triton kernels of the MoE combine on CUDA (`moe.gather_sum` and `moe.combine_grad`, same math
as their torch implementations there).

- `gather_sum`: out[t] = sum_k w[t, k] * src[index[t, k]], one program per (token, slice of the
  hidden width), the K rows read once and summed in fp32. It is the combine's forward (src = the
  expert outputs in expert order) and the dispatch's backward (src = their gradients, no weights).
- `combine_grad`: the combine's backward, one program per token: grad_src[index[t, k]] =
  w[t, k] * g[t] and grad_w[t, k] = <g[t], src[index[t, k]]> (fp32), g read once per slice.

Inductor's code for the same work (a gather that materialises the [T, K, D] rows, then a reduction)
ran at about 480 GB/s on an H200 (docs/benchmarks.md); these read each row once.

Shape legend: T tokens, K experts per token, D hidden, P = T * K rows in expert order.
"""

# Triton reads a kernel's annotations as specialisation hints, so its pointer arguments stay bare.
# ruff: noqa: ANN001

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _gather_sum_kernel(src_ptr, index_ptr, weight_ptr, out_ptr, D, K: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                       BLOCK: tl.constexpr):  # fmt: skip
    """One (token t, slice of D): out[t, slice] = sum_k w[t, k] * src[index[t, k], slice]."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < D
    acc = tl.zeros([BLOCK], tl.float32)
    for k in tl.static_range(K):
        row = tl.load(index_ptr + t * K + k).to(tl.int64)
        x = tl.load(src_ptr + row * D + offs, mask=valid, other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            x = x * tl.load(weight_ptr + t * K + k).to(tl.float32)
        acc += x
    tl.store(out_ptr + t * D + offs, acc.to(out_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _combine_grad_kernel(grad_ptr, src_ptr, index_ptr, weight_ptr, grad_src_ptr, grad_weight_ptr, D,
                         K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """One token t: grad_src[index[t, k]] = w[t, k] * g[t] and grad_w[t, k] = <g[t], src[index[t, k]]>."""
    t = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, KP)
    dots = tl.zeros([KP], tl.float32)
    for start in range(0, D, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        valid = offs < D
        g = tl.load(grad_ptr + t * D + offs, mask=valid, other=0.0).to(tl.float32)
        for k in tl.static_range(K):
            row = tl.load(index_ptr + t * K + k).to(tl.int64)
            w = tl.load(weight_ptr + t * K + k).to(tl.float32)
            x = tl.load(src_ptr + row * D + offs, mask=valid, other=0.0).to(tl.float32)
            dots = tl.where(ks == k, dots + tl.sum(g * x, axis=0), dots)
            tl.store(grad_src_ptr + row * D + offs, (w * g).to(grad_src_ptr.dtype.element_ty), mask=valid)
    tl.store(grad_weight_ptr + t * K + ks, dots.to(grad_weight_ptr.dtype.element_ty), mask=ks < K)


def gather_sum(src_PD: torch.Tensor, index_TK: torch.Tensor, weight_TK: torch.Tensor | None) -> torch.Tensor:
    """[T, D] in src's dtype: out[t] = sum_k w[t, k] * src[index[t, k]] (w = 1 without weights)."""
    T, K = index_TK.shape
    D = src_PD.shape[-1]
    out_TD = src_PD.new_empty(T, D)
    if T == 0 or D == 0:
        return out_TD.zero_()
    src_PD, index_TK = src_PD.contiguous(), index_TK.contiguous()
    weight = index_TK if weight_TK is None else weight_TK.contiguous()
    _gather_sum_kernel[(T, triton.cdiv(D, BLOCK))](
        src_PD, index_TK, weight, out_TD, D, K=K, HAS_WEIGHT=weight_TK is not None, BLOCK=BLOCK, num_warps=4
    )
    return out_TD


def combine_grad(
    grad_TD: torch.Tensor, src_PD: torch.Tensor, index_TK: torch.Tensor, weight_TK: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_src [P, D] in src's dtype, grad_weight [T, K] in the weights' dtype) of `gather_sum`
    with weights, for an `index_TK` that holds every row of src once (a permutation)."""
    T, K = index_TK.shape
    D = src_PD.shape[-1]
    grad_src_PD = torch.empty_like(src_PD)
    grad_weight_TK = torch.empty_like(weight_TK)
    if T == 0 or D == 0:
        return grad_src_PD.zero_(), grad_weight_TK.zero_()
    _combine_grad_kernel[(T,)](
        grad_TD.contiguous(), src_PD.contiguous(), index_TK.contiguous(), weight_TK.contiguous(),
        grad_src_PD, grad_weight_TK, D, K=K, KP=triton.next_power_of_2(K), BLOCK=BLOCK, num_warps=4,
    )  # fmt: skip
    return grad_src_PD, grad_weight_TK
