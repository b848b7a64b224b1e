"""Batch-invariant Triton kernels for `rollout.match_training` on CUDA: a matrix product, the
experts' grouped product of MoE layers and the row reductions (sum, log-sum-exp) of `exact.py`'s
numerics, each output element computed in one
order that depends only on its own inputs, never on the number of rows, the row's place among
them or the other rows (the GPU half of what `exact.tree_sum` does on the CPU).

- `matmul`: ONE tile configuration for every shape (BLOCK_M x BLOCK_N x BLOCK_K, no split-K, no
  autotuning): each output element is its row of A times its column of B, accumulated in fp32 over
  K in BLOCK_K steps from k = 0, so the sum is the same whatever M is (torch's cuBLAS picks a kernel,
  and sometimes a split-K, from the shape: a token's logits then depend on how many tokens share
  its matmul). The bias of addmm is added in the fp32 epilogue; the output has the inputs' dtype, or
  fp32 (`out_dtype`: a router's bf16 x bf16 -> fp32 logits).
- `grouped_matmul`: the routed experts' product (rows sorted by expert, each expert's slice times
  its weight), with the same tiles and the same K loop as `matmul`, so a token's row is the same
  bits whatever number of tokens its expert got or where its slice starts (torch._grouped_mm and the
  decode kernel of `expert_kernels.py` pick their tiles from the row count).
- `row_sum` and `row_logsumexp`: one program per row of a contiguous [R, C] tensor, BLOCK lanes
  walking the row in order, then one fixed reduction tree over the lanes (torch's CUDA reductions
  split a row across blocks when there are few rows). Log-sum-exp is max + log(sum exp(x - max))
  in two passes over the row.

Every launch passes the same compile-time constants, and the sizes that differ between the engines
(the row count M; N, where the rollout fuses q/k/v and gate/up into one product) are not
specialised on, so training and rollout run the same compiled kernel. Row inputs (and a product's
A) are made contiguous and 16-byte aligned first: Triton specialises on alignment, and a different
vector width would change the order of the lane sums. FMA contraction
is off (`enable_fp_fusion=False`): every multiply and add rounds as written.

Shape legend: M rows, K reduction, N columns, R rows, C row length, Bt batch of bmm, P rows of the
grouped product, E experts.
"""

# Triton reads a kernel's annotations as specialisation hints, so its pointer arguments stay bare.
# ruff: noqa: ANN001

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M = 128, 128, 64, 8
MM_WARPS, MM_STAGES = 8, 3
ROW_BLOCK, ROW_WARPS = 1024, 4


@triton.jit(do_not_specialize=["M", "N"])
def _matmul_kernel(
    a_ptr, b_ptr, bias_ptr, c_ptr, M, N, K,
    stride_ab, stride_am, stride_ak, stride_bb, stride_bk, stride_bn, stride_cb, stride_cm, stride_cn,
    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """One [BLOCK_M, BLOCK_N] tile of batch entry program_id(1): acc += A[:, k:k+BLOCK_K] @ B[k:k+BLOCK_K, :]
    from k = 0 up, in fp32; rows and columns past M, N and K read as 0."""
    pid = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # Grouped tile order (GROUP_M row tiles share their B tiles in L2): which tile a program
    # computes, never how.
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + batch * stride_ab + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + batch * stride_bb + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < K - k), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < K - k) & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + batch * stride_cb + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def matmul(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """a [M, K] @ b [K, N] (+ bias [N]) -> [M, N], or a [Bt, M, K] @ b [Bt, K, N] -> [Bt, M, N]
    (bmm), in `out_dtype` (default a's dtype). a is made contiguous and aligned (a slice of
    activations becomes a copy); b keeps its strides (a linear's b is its weight transposed, the same
    view in both engines)."""
    assert a.dtype == b.dtype and a.is_floating_point(), (a.dtype, b.dtype)
    a = _aligned(a)
    batched = a.dim() == 3
    a3, b3 = (a, b) if batched else (a.unsqueeze(0), b.unsqueeze(0))
    Bt, M, K = a3.shape
    N = b3.shape[-1]
    assert b3.shape[:2] == (Bt, K), (a.shape, b.shape)
    c3 = torch.empty(Bt, M, N, dtype=out_dtype or a.dtype, device=a.device)
    if M and N:
        if bias is not None:
            assert bias.shape == (N,), (bias.shape, N)
            bias = bias.to(a.dtype).contiguous()
        grid = (triton.cdiv(M, BLOCK_M) * triton.cdiv(N, BLOCK_N), Bt)
        _matmul_kernel[grid](
            a3, b3, a3 if bias is None else bias, c3, M, N, K,
            *a3.stride(), *b3.stride(), *c3.stride(),
            HAS_BIAS=bias is not None, PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, GROUP_M=GROUP_M,
            num_warps=MM_WARPS, num_stages=MM_STAGES, enable_fp_fusion=False,
        )  # fmt: skip
    return c3 if batched else c3[0]


@triton.jit(do_not_specialize=["N", "M_SLOTS"])
def _grouped_matmul_kernel(
    x_ptr, w_ptr, offsets_ptr, y_ptr, N, K, M_SLOTS, stride_we, stride_wn, stride_wk,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Expert program_id(0)'s row tiles program_id(2), + M_SLOTS, ... (tiles start at its first row)
    times columns program_id(1) of w[e].T, each tile as `_matmul_kernel` computes one: acc +=
    x[:, k:k+BLOCK_K] @ w[e].T[k:k+BLOCK_K, :] from k = 0 up, in fp32; rows past the expert's end
    and columns past N and K read as 0."""
    e = tl.program_id(0).to(tl.int64)
    start = tl.load(offsets_ptr + e - 1, mask=e > 0, other=0).to(tl.int32)
    end = tl.load(offsets_ptr + e).to(tl.int32)
    offs_n = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    w_tile = w_ptr + e * stride_we + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
    for m0 in range(start + tl.program_id(2) * BLOCK_M, end, M_SLOTS * BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * K + offs_k[None, :]
        w_ptrs = w_tile
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            a = tl.load(x_ptrs, mask=(offs_m[:, None] < end) & (offs_k[None, :] < K - k), other=0.0)
            b = tl.load(w_ptrs, mask=(offs_k[:, None] < K - k) & (offs_n[None, :] < N), other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * stride_wk
        y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(offs_m[:, None] < end) & (offs_n[None, :] < N))


def grouped_matmul(x_PK: torch.Tensor, w_ENK: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """[P, N] in x's dtype: rows offsets[e-1]:offsets[e] of x (int32 cumulative counts: rows sorted by
    expert) times w[e].T. No host sync: each expert's programs read its rows from `offsets`, and the
    grid has enough row slots for P rows over E experts (an expert with more rows walks them)."""
    assert x_PK.dtype == w_ENK.dtype and x_PK.is_floating_point(), (x_PK.dtype, w_ENK.dtype)
    assert offsets_E.dtype == torch.int32 and offsets_E.is_contiguous(), offsets_E.dtype
    x = _aligned(x_PK)
    P, K = x.shape
    E, N, _ = w_ENK.shape
    y = torch.empty(P, N, dtype=x.dtype, device=x.device)
    if P and N:
        m_slots = triton.cdiv(P, E * BLOCK_M)
        _grouped_matmul_kernel[(E, triton.cdiv(N, BLOCK_N), m_slots)](
            x, w_ENK, offsets_E, y, N, K, m_slots, *w_ENK.stride(),
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
            num_warps=MM_WARPS, num_stages=MM_STAGES, enable_fp_fusion=False,
        )  # fmt: skip
    return y


@triton.jit
def _row_sum_kernel(x_ptr, out_ptr, C, BLOCK: tl.constexpr):
    """out[r] = sum of row r: lane i adds x[r, i], x[r, i + BLOCK], ... in order, then one tree."""
    row = x_ptr + tl.program_id(0).to(tl.int64) * C
    lanes = tl.zeros([BLOCK], tl.float32)
    for start in range(0, C, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        lanes += tl.load(row + offs, mask=offs < C, other=0.0).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(lanes, axis=0).to(out_ptr.dtype.element_ty))


@triton.jit
def _row_logsumexp_kernel(x_ptr, out_ptr, C, BLOCK: tl.constexpr):
    """out[r] = max + log(sum exp(x - max)) over row r (max = 0 for a row of -inf: out = -inf)."""
    row = x_ptr + tl.program_id(0).to(tl.int64) * C
    lanes_max = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, C, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(row + offs, mask=offs < C, other=float("-inf")).to(tl.float32)
        lanes_max = tl.maximum(lanes_max, x)
    m = tl.max(lanes_max, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    lanes = tl.zeros([BLOCK], tl.float32)
    for start in range(0, C, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(row + offs, mask=offs < C, other=float("-inf")).to(tl.float32)
        lanes += tl.exp(x - m)
    lse = m + tl.log(tl.sum(lanes, axis=0))
    tl.store(out_ptr + tl.program_id(0), lse.to(out_ptr.dtype.element_ty))


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """x as a contiguous, 16-byte aligned tensor (a copy only when it is not one)."""
    if x.is_contiguous() and x.data_ptr() % 16 == 0:
        return x
    return x.clone(memory_format=torch.contiguous_format)


def _row_op(kernel, x_RC: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    R, C = x_RC.shape
    out_R = torch.empty(R, dtype=x_RC.dtype, device=x_RC.device)
    if R:
        kernel[(R,)](_aligned(x_RC), out_R, C, BLOCK=ROW_BLOCK, num_warps=ROW_WARPS, enable_fp_fusion=False)
    return out_R


def row_sum(x_RC: torch.Tensor) -> torch.Tensor:
    """[R] sums of the rows of x [R, C] in x's dtype (fp32 accumulation; 0 for C = 0)."""
    return _row_op(_row_sum_kernel, x_RC)


def row_logsumexp(x_RC: torch.Tensor) -> torch.Tensor:
    """[R] log-sum-exp of the rows of x [R, C] in x's dtype (fp32 inside)."""
    return _row_op(_row_logsumexp_kernel, x_RC)
