"""Triton kernel of the experts' grouped product at few rows an expert (decode), on CUDA:
y = x @ w[e].T for the rows of expert e, with bf16 weights (`moe.expert_linear`) or fp8 ones and
their scales (`fp8.fp8_linear`).

One program per (expert e, block of BLOCK_N output rows, slot m): it walks expert e's rows of x in
tiles of BLOCK_M, starting at tile m and striding by the grid's third dimension (so a skewed
expert with many rows is shared by several programs, and an expert with none costs one offsets
read). For each tile it steps over K in blocks of BLOCK_K columns: the weight tile [BLOCK_K,
BLOCK_N] is loaded (fp8: times its per-row scales, one block being one scale group, rounded to x's
dtype as the reference path dequantizes) and multiplied on tensor cores into an fp32 accumulator.

The expert's row range comes from `offsets` on the device, so the launch needs no host sync and
CUDA graphs can capture it (decode steps). Decode is weight-bound: each weight byte is read once per
row tile, and at decode batch sizes an expert has a single tile. There this kernel reads bf16
weights at about 4 TB/s on an H200, where `torch._grouped_mm` (cutlass) reads them at 2.6-3.3
(1.3-1.7x; `benchmarks/bench_fp8.py`, docs/benchmarks.md); with many rows an expert each row tile
reads the weights again, and `torch._grouped_mm` is faster (the caller's choice: `fits_rows`).

Shape legend: P rows of x, K input columns, N output rows, E experts (weights stacked [E, N, K]).
"""

# Triton reads a kernel's annotations as specialisation hints, so its pointer arguments stay bare.
# ruff: noqa: ANN001

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BF16_ROWS = 32
"""The most rows an expert gets on average (P / E) for which the bf16 kernel is used."""


@triton.jit
def _expert_linear_kernel(x_ptr, w_ptr, s_ptr, offsets_ptr, y_ptr, N, K, G, M_SLOTS, SCALED: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    e = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.program_id(2)
    start = tl.load(offsets_ptr + e - 1, mask=e > 0, other=0).to(tl.int32)
    end = tl.load(offsets_ptr + e).to(tl.int32)
    n_ok = n < N
    w_cols = w_ptr + e * N * K + n.to(tl.int64)[None, :] * K  # the weight read as [K, N]
    s_cols = s_ptr + e * N * G + n.to(tl.int64) * G
    ks = tl.arange(0, BLOCK_K)
    for m0 in range(start + slot * BLOCK_M, end, M_SLOTS * BLOCK_M):
        m = m0 + tl.arange(0, BLOCK_M)
        m_ok = m < end
        x_rows = x_ptr + m.to(tl.int64)[:, None] * K
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + ks
            k_ok = k < K
            x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_cols + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if SCALED:  # one BLOCK_K block is one scale group
                s = tl.load(s_cols + k0 // BLOCK_K, mask=n_ok, other=0.0)
                w = (w.to(tl.float32) * s[None, :]).to(x.dtype)  # dequantized in registers
            acc = tl.dot(x, w, acc)
        y = y_ptr + m.to(tl.int64)[:, None] * N + n[None, :]
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def fits_rows(rows: int, experts: int) -> bool:
    """Whether the bf16 kernel beats `torch._grouped_mm` for `rows` spread over `experts`."""
    return rows <= MAX_BF16_ROWS * experts


def _fp8_blocks(rows_per_expert: float) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of the fp8 kernel for the average rows an
    expert gets (sweeps on an H200 at decode sizes, with uniformly random routing for the first
    two: docs/benchmarks.md)."""
    if rows_per_expert <= 8:
        return 16, 128, 128, 4, 3
    if rows_per_expert <= 16:
        return 32, 128, 128, 4, 4
    return (64, 128, 128, 4, 3) if rows_per_expert <= 64 else (128, 128, 128, 8, 4)


def _bf16_blocks(rows_per_expert: float) -> tuple[int, int, int, int, int]:
    """The same for bf16 weights (a sweep on an H200 with uniformly random routing, whose busiest
    expert gets about twice the average: one row tile holds it)."""
    if rows_per_expert <= 8:
        return 16, 128, 128, 4, 3
    return (32, 128, 128, 4, 3) if rows_per_expert <= 16 else (64, 64, 64, 4, 3)


def expert_linear(
    x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, scale: torch.Tensor | None = None, group: int = 0
) -> torch.Tensor:
    """x [P, K] -> [P, N] in x's dtype: rows offsets[e-1]:offsets[e] times w[e].T (w [E, N, K]); with
    `scale` [E, N, G], w is fp8 and w[n, k] * scale[n, k // group] its value."""
    P, K = x.shape
    E, N, _ = w.shape
    x, w = x.contiguous(), w.contiguous()
    y = torch.empty(P, N, dtype=x.dtype, device=x.device)
    if P == 0:
        return y
    if scale is None:
        block_m, block_n, block_k, warps, stages = _bf16_blocks(P / E)
        scale, groups = w, 0  # an unread pointer
    else:
        block_m, block_n, _, warps, stages = _fp8_blocks(P / E)
        block_k, scale, groups = group, scale.contiguous(), scale.shape[-1]
    m_slots = max(1, -(-P // (E * block_m)))
    grid = (E, triton.cdiv(N, block_n), m_slots)
    _expert_linear_kernel[grid](
        x, w, scale, offsets, y, N, K, groups, m_slots, SCALED=groups > 0, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y
