"""Fused batch-invariant Triton kernels for the elementwise and per-row work of a decoder layer under
`rollout.match_training` on CUDA (`exact.py`): RMSNorm, SwiGLU's silu(gate) * up and the rotary
embedding, forward and backward, each one kernel where the eager formula is five to ten (casts,
squares, a mean, rsqrt, products; each a launch and a round trip of the activations through memory).

Why a token's bits do not depend on its batch (both engines call these same kernels from
`layers.py`, so the rollout's decode, its prefill and the training forward agree bit for bit):
- `rms_norm`: one program per row; the row is loaded whole into a block whose size, and the launch's
  warp count, are functions of the row width C only, and its sum of squares is one fixed reduction
  tree over that block. The number of rows only sets the grid. The row is made contiguous and
  16-byte aligned first (Triton picks a vector width from the alignment, which could change the
  tree).
- `silu_mul`, `rope`: elementwise (each output from its own inputs by the same code at any index),
  computed in fp32 and rounded once.

The backward passes need to be deterministic, not batch-invariant: RMSNorm's weight gradient is
summed over rows in two fixed stages (blocks of `NORM_BWD_ROWS` rows write fp32 partials in row
order, then one program per column block adds the partials in block order), with no atomics.
FMA contraction is off (`enable_fp_fusion=False`) in every launch: each multiply and add rounds as
written, as in `exact_kernels.py`.

Shape legend: R rows (tokens, or tokens x heads), C row width, H heads, D head dim, P partial rows.
"""

# Triton reads a kernel's annotations as specialisation hints, so its pointer arguments stay bare.
# ruff: noqa: ANN001

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlloom.models.exact_kernels import _aligned
from rlloom.models.logprobs import scaled_logprobs

NORM_BWD_ROWS = 32
"""Rows per program of RMSNorm's backward: the first stage of the weight gradient's fixed-order sum."""
ELEMENTWISE_BLOCK = 1024


def _row_warps(block: int) -> int:
    """Warps of a one-row program: a function of the block (so of the row width) only."""
    return min(max(block // 256, 1), 8)


@triton.jit
def _rms_norm_fwd_kernel(x_ptr, w_ptr, y_ptr, C, eps, BLOCK: tl.constexpr):
    """y[r] = w * round_to_x_dtype(x[r] * rsqrt(mean(x[r]^2) + eps)), in fp32, one program per row."""
    row = tl.program_id(0).to(tl.int64) * C
    offs = tl.arange(0, BLOCK)
    mask = offs < C
    x = tl.load(x_ptr + row + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / C + eps)
    x_hat = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row + offs, (w * x_hat).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["R"])
def _rms_norm_bwd_kernel(
    x_ptr, w_ptr, dy_ptr, dx_ptr, dw_part_ptr, R, C, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr
):
    """dx of rows ROWS * pid ... (one at a time, in order) and their weight-gradient partial
    sum(dy * x_hat) into row pid of dw_part (fp32)."""
    offs = tl.arange(0, BLOCK)
    mask = offs < C
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], tl.float32)
    for i in range(ROWS):
        r = tl.program_id(0).to(tl.int64) * ROWS + i
        live = mask & (offs * 0 + r < R)  # a vector mask: the interpreter takes no scalar one
        x = tl.load(x_ptr + r * C + offs, mask=live, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + r * C + offs, mask=live, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / C + eps)
        x_hat = x * rstd
        dw += dy * x_hat.to(x_ptr.dtype.element_ty).to(tl.float32)
        g = dy * w
        dx = rstd * (g - x_hat * (tl.sum(g * x_hat, axis=0) / C))
        tl.store(dx_ptr + r * C + offs, dx.to(dx_ptr.dtype.element_ty), mask=live)
    tl.store(dw_part_ptr + tl.program_id(0).to(tl.int64) * C + offs, dw, mask=mask)


@triton.jit(do_not_specialize=["P"])
def _column_sum_kernel(part_ptr, out_ptr, P, C, BLOCK: tl.constexpr):
    """out[c] = part[0, c] + part[1, c] + ... in row order, for the columns of program pid."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < C
    acc = tl.zeros([BLOCK], tl.float32)
    for p in range(P):
        acc += tl.load(part_ptr + p * C + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _launch_rms_norm_fwd(x_RC: torch.Tensor, w_C: torch.Tensor, eps: float, out_dtype: torch.dtype):
    R, C = x_RC.shape
    y = torch.empty(R, C, dtype=out_dtype, device=x_RC.device)
    if R:
        block = triton.next_power_of_2(C)
        _rms_norm_fwd_kernel[(R,)](
            x_RC, w_C, y, C, eps, BLOCK=block, num_warps=_row_warps(block), enable_fp_fusion=False
        )
    return y


def _launch_rms_norm_bwd(x_RC: torch.Tensor, w_C: torch.Tensor, dy_RC: torch.Tensor, eps: float):
    R, C = x_RC.shape
    dx = torch.empty_like(x_RC)
    parts = triton.cdiv(R, NORM_BWD_ROWS)
    dw_part = torch.empty(parts, C, dtype=torch.float32, device=x_RC.device)
    dw = torch.empty(C, dtype=w_C.dtype, device=x_RC.device)
    if not R:
        return dx, dw.zero_()
    block = triton.next_power_of_2(C)
    _rms_norm_bwd_kernel[(parts,)](
        x_RC, w_C, dy_RC, dx, dw_part, R, C, eps,
        ROWS=NORM_BWD_ROWS, BLOCK=block, num_warps=_row_warps(block), enable_fp_fusion=False,
    )  # fmt: skip
    _column_sum_kernel[(triton.cdiv(C, ELEMENTWISE_BLOCK),)](
        dw_part, dw, parts, C, BLOCK=ELEMENTWISE_BLOCK, num_warps=4, enable_fp_fusion=False
    )
    return dx, dw


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RC: torch.Tensor, w_C: torch.Tensor, eps: float, out_dtype: torch.dtype):  # noqa: ANN205
        ctx.save_for_backward(x_RC, w_C)
        ctx.eps = eps
        return _launch_rms_norm_fwd(x_RC, w_C, eps, out_dtype)

    @staticmethod
    def backward(ctx, dy_RC: torch.Tensor):  # noqa: ANN205
        x_RC, w_C = ctx.saved_tensors
        dx, dw = _launch_rms_norm_bwd(x_RC, w_C, _aligned(dy_RC), ctx.eps)
        return dx, dw, None, None


def rms_norm(x: torch.Tensor, weight_C: torch.Tensor, eps: float) -> torch.Tensor:
    """`layers.RMSNorm`'s weight * (x / rms(x)).to(x.dtype) over the last dim of x [..., C], in
    the dtype torch's promotion of (weight, x) gives; differentiable in x and the weight."""
    out_dtype = torch.promote_types(weight_C.dtype, x.dtype)
    x_RC, w_C = _aligned(x.reshape(-1, x.shape[-1])), _aligned(weight_C)
    return _RMSNorm.apply(x_RC, w_C, eps, out_dtype).reshape(x.shape)


@triton.jit(do_not_specialize=["R"])
def _silu_mul_fwd_kernel(g_ptr, u_ptr, y_ptr, R, C, stride_g, stride_u, BLOCK: tl.constexpr):
    """y[r, c] = silu(g[r, c]) * u[r, c] in fp32, rounded once; program (r, c block)."""
    r = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < C
    g = tl.load(g_ptr + r * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + r * stride_u + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + r * C + offs, (g * tl.sigmoid(g) * u).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["R"])
def _silu_mul_bwd_kernel(g_ptr, u_ptr, dy_ptr, dg_ptr, du_ptr, R, C, BLOCK: tl.constexpr):
    """dg = dy * u * s * (1 + g * (1 - s)) with s = sigmoid(g), du = dy * silu(g)."""
    r = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < C
    g = tl.load(g_ptr + r * C + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + r * C + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + r * C + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    tl.store(
        dg_ptr + r * C + offs, (dy * u * s * (1.0 + g * (1.0 - s))).to(dg_ptr.dtype.element_ty), mask=mask
    )
    tl.store(du_ptr + r * C + offs, (dy * (g * s)).to(du_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., C] as [R, C] with unit column stride (a view where one exists: the rollout's fused
    gate/up halves keep their row stride)."""
    x_RC = x.reshape(-1, x.shape[-1])
    return x_RC if x_RC.stride(-1) == 1 else x_RC.contiguous()


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_RC: torch.Tensor, up_RC: torch.Tensor):  # noqa: ANN205
        R, C = gate_RC.shape
        y = torch.empty(R, C, dtype=gate_RC.dtype, device=gate_RC.device)
        if R and C:
            _silu_mul_fwd_kernel[(R, triton.cdiv(C, ELEMENTWISE_BLOCK))](
                gate_RC, up_RC, y, R, C, gate_RC.stride(0), up_RC.stride(0),
                BLOCK=ELEMENTWISE_BLOCK, num_warps=4, enable_fp_fusion=False,
            )  # fmt: skip
        ctx.save_for_backward(gate_RC, up_RC)
        return y

    @staticmethod
    def backward(ctx, dy_RC: torch.Tensor):  # noqa: ANN205
        gate_RC, up_RC = (t.contiguous() for t in ctx.saved_tensors)
        dy_RC = dy_RC.contiguous()
        R, C = gate_RC.shape
        dg, du = torch.empty_like(gate_RC), torch.empty_like(up_RC)
        if R and C:
            _silu_mul_bwd_kernel[(R, triton.cdiv(C, ELEMENTWISE_BLOCK))](
                gate_RC, up_RC, dy_RC, dg, du, R, C,
                BLOCK=ELEMENTWISE_BLOCK, num_warps=4, enable_fp_fusion=False,
            )  # fmt: skip
        return dg, du


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up for gate, up [..., C] of one dtype (differentiable in both)."""
    assert gate.shape == up.shape and gate.dtype == up.dtype, (gate.shape, up.shape, gate.dtype, up.dtype)
    return _SiluMul.apply(_rows(gate), _rows(up)).reshape(gate.shape)


@triton.jit(do_not_specialize=["R"])
def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr, y_ptr, R, H, stride_xr, stride_xh,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
    IN_STEP: tl.constexpr, IN_SECOND: tl.constexpr, OUT_STEP: tl.constexpr, OUT_SECOND: tl.constexpr,
    BACKWARD: tl.constexpr,
):  # fmt: skip
    """All heads of token program_id(0). Pair j < HALF is channels (j * STEP, j * STEP + SECOND):
    (j, j + HALF) for rotated halves, (2j, 2j + 1) for interleaved pairs (`_pair_layout`). Forward:
    y_a = x_a c_a - x_b s_a, y_b = x_b c_b + x_a s_b (`apply_rope`); backward (its transpose):
    dx_a = dy_a c_a + dy_b s_b, dx_b = dy_b c_b - dy_a s_a."""
    r = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    j = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < H) & (j < HALF)
    x_row = x_ptr + r * stride_xr + h * stride_xh
    xa = tl.load(x_row + j * IN_STEP, mask=mask, other=0.0).to(tl.float32)
    xb = tl.load(x_row + j * IN_STEP + IN_SECOND, mask=mask, other=0.0).to(tl.float32)
    cs_row = r * (2 * HALF) + j
    ca = tl.load(cos_ptr + cs_row, mask=j < HALF, other=0.0).to(tl.float32)
    cb = tl.load(cos_ptr + cs_row + HALF, mask=j < HALF, other=0.0).to(tl.float32)
    sa = tl.load(sin_ptr + cs_row, mask=j < HALF, other=0.0).to(tl.float32)
    sb = tl.load(sin_ptr + cs_row + HALF, mask=j < HALF, other=0.0).to(tl.float32)
    if BACKWARD:
        ya = xa * ca + xb * sb
        yb = xb * cb - xa * sa
    else:
        ya = xa * ca - xb * sa
        yb = xb * cb + xa * sb
    y_row = y_ptr + r * H * (2 * HALF) + h * (2 * HALF)
    tl.store(y_row + j * OUT_STEP, ya.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_row + j * OUT_STEP + OUT_SECOND, yb.to(y_ptr.dtype.element_ty), mask=mask)


def _pair_layout(interleaved: bool, half: int) -> tuple[int, int]:
    """(STEP, SECOND) of `_rope_kernel`: where pair j's two channels sit in a head of 2 * half."""
    return (2, 1) if interleaved else (1, half)


def _launch_rope(
    x_RHD: torch.Tensor,
    cos_RD: torch.Tensor,
    sin_RD: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    in_pairs: bool,
    out_pairs: bool,
    backward: bool,
) -> torch.Tensor:
    R, H, D = x_RHD.shape
    y = torch.empty(R, H, D, dtype=out_dtype, device=x_RHD.device)
    if R and H:
        half = D // 2
        block_h, block_half = triton.next_power_of_2(H), triton.next_power_of_2(half)
        (in_step, in_second), (out_step, out_second) = (
            _pair_layout(in_pairs, half),
            _pair_layout(out_pairs, half),
        )
        _rope_kernel[(R,)](
            x_RHD, cos_RD, sin_RD, y, R, H, x_RHD.stride(0), x_RHD.stride(1),
            HALF=half, BLOCK_H=block_h, BLOCK_HALF=block_half, IN_STEP=in_step, IN_SECOND=in_second,
            OUT_STEP=out_step, OUT_SECOND=out_second, BACKWARD=backward,
            num_warps=_row_warps(block_h * block_half), enable_fp_fusion=False,
        )  # fmt: skip
    return y


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RHD: torch.Tensor, cos_RD: torch.Tensor, sin_RD: torch.Tensor, interleaved: bool):  # noqa: ANN205
        assert not (ctx.needs_input_grad[1] or ctx.needs_input_grad[2]), "rope: cos/sin take no gradient"
        ctx.save_for_backward(cos_RD, sin_RD)
        ctx.interleaved, ctx.x_dtype = interleaved, x_RHD.dtype
        out_dtype = torch.promote_types(x_RHD.dtype, cos_RD.dtype)
        return _launch_rope(
            x_RHD, cos_RD, sin_RD, out_dtype, in_pairs=interleaved, out_pairs=False, backward=False
        )

    @staticmethod
    def backward(ctx, dy_RHD: torch.Tensor):  # noqa: ANN205
        cos_RD, sin_RD = ctx.saved_tensors
        dx = _launch_rope(
            dy_RHD.contiguous(),
            cos_RD,
            sin_RD,
            ctx.x_dtype,
            in_pairs=False,
            out_pairs=ctx.interleaved,
            backward=True,
        )
        return dx, None, None, None


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """`layers.apply_rope`: x [..., H, D] rotated by cos/sin [..., D] (broadcast over the heads and
    to x's leading dims); interleaved pairs come out de-interleaved, as `apply_rope` gives them."""
    lead, (H, D) = x.shape[:-2], x.shape[-2:]
    x_RHD = x.reshape(-1, H, D)
    if x_RHD.stride(-1) != 1:
        x_RHD = x_RHD.contiguous()
    cos_RD, sin_RD = (t.expand(*lead, D).reshape(-1, D).contiguous() for t in (cos, sin))
    return _Rope.apply(x_RHD, cos_RD, sin_RD, interleaved).reshape(*lead, H, D)


@triton.jit
def _row_entropy_sum_kernel(z_ptr, lse_ptr, out_ptr, C, BLOCK: tl.constexpr):
    """out[r] = sum of exp(z - lse[r]) * z over row r: lane i adds columns i, i + BLOCK, ... in order,
    then one tree over the lanes (`exact_kernels._row_sum_kernel`'s order)."""
    row = z_ptr + tl.program_id(0).to(tl.int64) * C
    lse = tl.load(lse_ptr + tl.program_id(0))
    lanes = tl.zeros([BLOCK], tl.float32)
    for start in range(0, C, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        z = tl.load(row + offs, mask=offs < C, other=float("-inf"))
        lanes += tl.where(offs < C, tl.exp(z - lse) * z, 0.0)
    tl.store(out_ptr + tl.program_id(0), tl.sum(lanes, axis=0))


def chunk_stats(
    logits_CV: torch.Tensor, targets_C: torch.Tensor, inv_temp: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`logprobs.chunk_stats` under exact numerics on CUDA: z and its log-sum-exp exactly as there
    (the numerics' `row_logsumexp`, so logp keeps the bits the rollout's sampler gets), and the
    entropy's sum(p * z) in one pass over z (one program per row, a fixed order: deterministic)
    where the torch formula writes and reads three fp32 [C, V] temporaries."""
    z_CV, logp_C, lse_C = scaled_logprobs(logits_CV, targets_C, inv_temp)
    if not with_entropy:
        return logp_C, lse_C, None
    z_CV, lse_C = _aligned(z_CV), lse_C.contiguous()
    C, V = z_CV.shape
    weighted_C = torch.empty(C, dtype=torch.float32, device=z_CV.device)
    if C:
        _row_entropy_sum_kernel[(C,)](
            z_CV, lse_C, weighted_C, V, BLOCK=ELEMENTWISE_BLOCK, num_warps=4, enable_fp_fusion=False
        )
    return logp_C, lse_C, lse_C - weighted_C
