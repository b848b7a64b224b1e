"""Batch-invariant causal attention for `rollout.match_training` on CUDA: ONE Triton kernel serves
the training forward (packed sequences, shared-prompt trees) and the rollout's paged prefill and
decode, so a query's output is the same bits whichever of them computes it.

Every call is described as runs (`Runs`): run u has q_len[u] queries, rows q_start[u].. of q, which
are the last q_len[u] positions of a key sequence of k_len[u] keys; key j of the run is row
kv_index[k_base[u] + j] of k and v. A packed sequence is one run (its keys are its own rows); a
shared-prompt branch is a run whose keys are its prompt's rows followed by its own (the prompt
itself is a run too); a rollout sequence is a run over its cache slots (its block table), with the
new tokens (decode: one) as its queries.

For each query row the kernel walks the keys of its run from key 0 in blocks of BLOCK_N keys
(aligned to the run's first key, not to the batch), with the online softmax of FlashAttention:
per block, scores q.k (fp32 accumulation on tensor cores) times the scale, keys after the query's
own position set to -inf, then m = max(m, block max), l = l * exp(m_old - m) + sum exp(s - m), acc =
acc * exp(m_old - m) + exp(s - m) @ v. A query therefore sees the same blocks with the same keys in
the same order on every path. A program holds ROWS >= 16 query rows (tl.dot's minimum): the G
query heads that share a kv head times ROWS / G consecutive queries of one run, and walks up to
its last query's position; blocks past a row's own position give it p = 0 (exactly: m and l stay,
acc adds 0), so the other rows of a program never change a row's result. Keys past the run's end
are never loaded (they are read as 0 with score -inf), so an unwritten cache slot cannot put a NaN
into p @ v.

The backward (training) recomputes the attention with the plain differentiable kernel the layout
uses otherwise (`attention(..., reference=...)`) and takes its gradient: the gradient of the same
function up to rounding; only the forward values need to be the rollout's.

Shape legend: N query tokens, R key/value rows (the stream, or the cache's slots), Hq/Hkv heads,
G = Hq / Hkv, D/Dv head dims, U runs, M entries of kv_index.

Head dims may differ: MLA (DeepSeek-V3) attends under the mode in its absorbed form in both engines
(models/mla.py), q [N, H, R + Dr] against one latent key head [R, 1, R + Dr] whose values are its
first R channels (v a view of k: read in place, `_keys_prefix`); D and Dv are padded to powers of
two separately.
"""

# Triton reads a kernel's annotations as specialisation hints, so its pointer arguments stay bare.
# ruff: noqa: ANN001

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

BLOCK_N, MIN_ROWS, WARPS = 64, 16, 4
WIDE_BLOCK_N, WIDE_STAGES, WIDE_CHANNELS = 16, 2, 512
"""Key blocks of 16 in a 2-stage pipeline where the padded q/k and v widths together pass 512
channels (MLA's latent: 1024 + 512), whose 64-key tiles do not fit in an H200's shared memory. A
function of the model's head widths only, so both engines still run one configuration."""


@dataclass(slots=True)
class Runs:
    """The query runs of one attention call (module docstring); int tensors on the device (the
    builders make them int32, as the kernel takes them)."""

    q_start: torch.Tensor
    """[U] first row of q of each run."""
    q_len: torch.Tensor
    """[U] queries of each run: the last q_len[u] of its k_len[u] positions."""
    k_base: torch.Tensor
    """[U] offset in kv_index of each run's first key."""
    k_len: torch.Tensor
    """[U] keys of each run."""
    kv_index: torch.Tensor
    """[M] row of k/v of each key."""
    max_q: int
    """The most queries of a run (sizes the grid)."""


def int32(x: torch.Tensor) -> torch.Tensor:
    """A run tensor as the kernel takes it: contiguous int32 (a no-op for the builders' tensors). One
    dtype for every caller, so training and rollout launch the same compiled kernel."""
    return x if x.dtype == torch.int32 and x.is_contiguous() else x.to(torch.int32).contiguous()


def packed_runs(cu_seqlens: torch.Tensor, max_seqlen: int, num_tokens: int) -> Runs:
    """Sequences packed back to back (`cu_seqlens` [S + 1] over `num_tokens` rows), each a causal
    run over its own rows."""
    rows = torch.arange(num_tokens, dtype=torch.int32, device=cu_seqlens.device)
    return varlen_runs(cu_seqlens, cu_seqlens, rows, max_seqlen)


def varlen_runs(cu_q: torch.Tensor, cu_k: torch.Tensor, kv_index: torch.Tensor, max_q: int) -> Runs:
    """Runs in FlashAttention varlen form: run u's queries are rows cu_q[u]..cu_q[u + 1] and its keys
    kv_index[cu_k[u]:cu_k[u + 1]] (queries at the end of the keys, as `TreePlan.varlen` builds)."""
    cu_q, cu_k = int32(cu_q), int32(cu_k)
    return Runs(
        int32(cu_q[:-1]), cu_q[1:] - cu_q[:-1], int32(cu_k[:-1]), cu_k[1:] - cu_k[:-1], int32(kv_index), max_q
    )


@triton.jit(do_not_specialize=["tiles_per_run"])
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, kv_index_ptr, q_start_ptr, q_len_ptr, k_base_ptr, k_len_ptr,
    scale, tiles_per_run,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_on, stride_oh,
    G: tl.constexpr, G_PAD: tl.constexpr, QUERIES: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr,
    D_PAD: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """One (tile of QUERIES queries of one run, kv head): ROWS = QUERIES * G_PAD rows, row r holding
    query r // G_PAD of the tile with the kv head's query head r % G_PAD."""
    run = tl.program_id(0) // tiles_per_run
    first = (tl.program_id(0) % tiles_per_run) * QUERIES
    kv_head = tl.program_id(1)
    q_len = tl.load(q_len_ptr + run)
    if first >= q_len:
        return
    q_start = tl.load(q_start_ptr + run).to(tl.int64)
    k_base = tl.load(k_base_ptr + run).to(tl.int64)
    pos0 = tl.load(k_len_ptr + run) - q_len
    r = tl.arange(0, ROWS)
    qi = first + r // G_PAD
    g = r % G_PAD
    row_ok = (qi < q_len) & (g < G)
    head = kv_head * G + g
    pos = pos0 + qi  # each row's position in its run's key sequence
    q_rows = q_start + qi
    d = tl.arange(0, D_PAD)
    dv = tl.arange(0, DV_PAD)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qn + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & (d[None, :] < D),
        other=0.0,
    )
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, DV_PAD], tl.float32)
    end = pos0 + tl.minimum(first + QUERIES, q_len)  # keys up to the tile's last query
    for start in range(0, end, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        key_ok = j < end
        kv_row = tl.load(kv_index_ptr + k_base + j, mask=key_ok, other=0).to(tl.int64)
        k = tl.load(
            k_ptr + kv_row[:, None] * stride_kn + kv_head * stride_kh + d[None, :],
            mask=key_ok[:, None] & (d[None, :] < D),
            other=0.0,
        )
        v = tl.load(
            v_ptr + kv_row[:, None] * stride_vn + kv_head * stride_vh + dv[None, :],
            mask=key_ok[:, None] & (dv[None, :] < DV),
            other=0.0,
        )
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        s = tl.where(j[None, :] <= pos[:, None], s, float("-inf"))  # j <= pos < end for a stored row
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_on + head[:, None] * stride_oh + dv[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & (dv[None, :] < DV),
    )


def attend_runs(
    q_NHD: torch.Tensor, k_RHD: torch.Tensor, v_RHD: torch.Tensor, scale: float, runs: Runs
) -> torch.Tensor:
    """[N, Hq, Dv] in q's dtype: each query of `runs` attends causally to its run's keys (no
    gradient; rows of q in no run are left unset)."""
    N, Hq, D = q_NHD.shape
    Hkv, Dv = k_RHD.shape[1], v_RHD.shape[2]
    assert Hq % Hkv == 0 and q_NHD.dtype == k_RHD.dtype == v_RHD.dtype, (q_NHD.shape, k_RHD.shape)
    G = Hq // Hkv
    g_pad = triton.next_power_of_2(G)
    queries = max(MIN_ROWS // g_pad, 1)
    q, k = q_NHD.contiguous(), k_RHD.contiguous()
    v = v_RHD if _keys_prefix(v_RHD, k) else v_RHD.contiguous()
    out = torch.empty(N, Hq, Dv, dtype=q.dtype, device=q.device)
    num_runs, tiles_per_run = runs.q_len.shape[0], triton.cdiv(max(runs.max_q, 1), queries)
    if N == 0 or num_runs == 0:
        return out
    index = (int32(x) for x in (runs.kv_index, runs.q_start, runs.q_len, runs.k_base, runs.k_len))
    d_pad, dv_pad = max(16, triton.next_power_of_2(D)), max(16, triton.next_power_of_2(Dv))
    wide = d_pad + dv_pad > WIDE_CHANNELS
    stages = {"num_stages": WIDE_STAGES} if wide else {}
    _attention_kernel[(num_runs * tiles_per_run, Hkv)](
        q, k, v, out, *index,
        scale, tiles_per_run, *q.stride()[:2], *k.stride()[:2], *v.stride()[:2], *out.stride()[:2],
        G=G, G_PAD=g_pad, QUERIES=queries, ROWS=queries * g_pad, D=D, D_PAD=d_pad, DV=Dv, DV_PAD=dv_pad,
        BLOCK_N=WIDE_BLOCK_N if wide else BLOCK_N, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=WARPS, enable_fp_fusion=False, **stages,
    )  # fmt: skip
    return out


def _keys_prefix(v: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether v is k[..., :Dv] (MLA's values, the latent in the keys' first channels, in training's
    stream and in the rollout's cache alike): then the kernel reads them in place, with k's strides
    on both sides, where a copy would cost the rollout its whole cache layer per call."""
    return v.data_ptr() == k.data_ptr() and v.stride() == k.stride() and v.shape[:-1] == k.shape[:-1]


Reference = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class _Attention(torch.autograd.Function):
    """`attend_runs` forward; backward: the gradient of `reference` (the plain kernel), recomputed."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float, runs: Runs, reference: Reference):  # noqa: ANN205
        ctx.save_for_backward(q, k, v)
        ctx.reference = reference
        return attend_runs(q, k, v, scale, runs)

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN205
        with torch.enable_grad():
            inputs = [x.detach().requires_grad_() for x in ctx.saved_tensors]
            out = ctx.reference(*inputs)
        return (*torch.autograd.grad(out, inputs, grad_out), None, None, None)


def attention(
    q_NHD: torch.Tensor,
    k_NHD: torch.Tensor,
    v_NHD: torch.Tensor,
    scale: float,
    runs: Runs,
    reference: Reference,
) -> torch.Tensor:
    """`attend_runs` over a stream whose k/v rows are its own, differentiable through `reference`
    (q, k, v -> the same attention by the layout's plain kernel)."""
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q_NHD, k_NHD, v_NHD)):
        return _Attention.apply(q_NHD, k_NHD, v_NHD, scale, runs, reference)
    return attend_runs(q_NHD, k_NHD, v_NHD, scale, runs)
