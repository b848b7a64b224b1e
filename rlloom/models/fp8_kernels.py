"""Triton kernel of `fp8.fp8_linear` on CUDA: y = x @ dequantized(q[e]).T for the rows of expert e.

One program per (expert e, block of BLOCK_N output rows, slot m): it walks expert e's rows of x in
tiles of BLOCK_M, starting at tile m and striding by the grid's third dimension (so a skewed
expert with many rows is shared by several programs, and an expert with none costs one offsets
read). For each tile it steps over K in the 128 columns of one scale group: the fp8 weight tile
[128, BLOCK_N] is dequantized in registers (times its per-row scales, rounded to x's dtype, as
the reference path dequantizes) and multiplied on tensor cores into an fp32 accumulator.

The expert's row range comes from `offsets` on the device, so the launch needs no host sync and
CUDA graphs can capture it (decode steps). Decode is weight-bound: each weight byte is read once per
row tile, and at decode batch sizes an expert has a single tile.

Shape legend: P rows of x, K input columns, N output rows, E experts (weights stacked [E, N, K]).
"""

# Triton reads a kernel's annotations as specialisation hints, so its pointer arguments stay bare.
# ruff: noqa: ANN001

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _fp8_linear_kernel(x_ptr, q_ptr, s_ptr, offsets_ptr, y_ptr, N, K, G, M_SLOTS, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    e = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.program_id(2)
    start = tl.load(offsets_ptr + e - 1, mask=e > 0, other=0).to(tl.int32)
    end = tl.load(offsets_ptr + e).to(tl.int32)
    n_ok = n < N
    w_cols = q_ptr + e * N * K + n.to(tl.int64)[None, :] * K  # the weight read as [K, N]
    s_cols = s_ptr + e * N * G + n.to(tl.int64) * G
    ks = tl.arange(0, BLOCK_K)
    for m0 in range(start + slot * BLOCK_M, end, M_SLOTS * BLOCK_M):
        m = m0 + tl.arange(0, BLOCK_M)
        m_ok = m < end
        x_rows = x_ptr + m.to(tl.int64)[:, None] * K
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for g in range(0, G):
            k = g * BLOCK_K + ks
            k_ok = k < K
            x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_cols + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            s = tl.load(s_cols + g, mask=n_ok, other=0.0)
            w = (w.to(tl.float32) * s[None, :]).to(x.dtype)  # dequantized in registers
            acc = tl.dot(x, w, acc)
        y = y_ptr + m.to(tl.int64)[:, None] * N + n[None, :]
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _blocks(rows_per_expert: float) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for the average rows an expert gets (from a sweep
    on an H200 at decode sizes, docs/benchmarks.md)."""
    if rows_per_expert <= 16:
        return 16, 128, 4, 3
    return (64, 128, 4, 3) if rows_per_expert <= 64 else (128, 128, 8, 4)


def fp8_linear(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    offsets: torch.Tensor,
    group: int,
) -> torch.Tensor:
    """See `fp8.fp8_linear` (the same contract; `group` columns share a scale)."""
    P, K = x.shape
    E, N, _ = q.shape
    x, q, scale = x.contiguous(), q.contiguous(), scale.contiguous()
    y = torch.empty(P, N, dtype=x.dtype, device=x.device)
    if P == 0:
        return y
    block_m, block_n, warps, stages = _blocks(P / E)
    m_slots = max(1, -(-P // (E * block_m)))
    grid = (E, triton.cdiv(N, block_n), m_slots)
    _fp8_linear_kernel[grid](
        x, q, scale, offsets, y, N, K, scale.shape[-1], m_slots, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=group, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y
