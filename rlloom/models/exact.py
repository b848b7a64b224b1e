"""Batch-invariant numerics (`rollout.match_training`): inside `exact_numerics()` every
op that reduces computes each output element in one fixed order that depends only on that element's
own inputs, never on how many rows share the call, where the row sits, or how long the padded key
axis is. The rollout engine (paged prefill and decode, shared prompts, any batch) and the training
forward (packed sequences, shared-prompt trees) then give a token the same hidden states, logits and
logprob, bit for bit.

How each kind of op is made invariant on the CPU:
- matrix products (mm, addmm, bmm, mm with an out_dtype): the products are exact elementwise multiplies and the sum over
  K is `tree_sum`, a halving tree over K padded with zeros to a power of two. Zero padding at the end
  leaves a halving tree's result unchanged, so the sum is also invariant to fused projections (each
  output column is its own dot product).
- sums and means over a dim, log-sum-exp, softmax, log-softmax: `tree_sum` along that dim;
  log-softmax is z - logsumexp(z), the formula the training head uses for a target's logprob.
- exp, log, rsqrt, sigmoid, silu, cos, sin, tanh, pow: torch's CPU kernels take a vectorised path
  for the body of a tensor and a scalar one for its tail, which may differ in the last bit, so a
  value would depend on its index in the batch. They are evaluated in float64 and rounded to the
  input's dtype (the two paths agree to well under a float32 ulp there).
- attention (`F.scaled_dot_product_attention`, intercepted above torch's kernel choice): for each
  query, the keys it may see are gathered to the front in key order, masked-out keys dropped
  (other branches of a shared prompt, the padding of a paged batch), then scores, softmax and the
  weighted sum of values are tree sums over that compacted axis.

Tensor parallelism (training's DTensors): the mode lets DTensor run first, so an op on shards reaches
it as the local ops of each rank (a row-parallel product: this rank's partial sum over its slice of
K, then the collective that adds the ranks' partials), as the rollout's tensor-parallel layers compute
it (`RowParallelLinear`: the local product, then an all-reduce). With two ranks the collective adds
two partials, a + b, the same bits in any order and either collective; the log-softmax of the
vocabulary-sharded head is taken over gathered logits on both sides (parallel/vocab_parallel.py).

Slow (every product is materialised): for tests and tiny models on the CPU. Backward passes are not
changed (the mode is only entered around forwards).

On CUDA the same ops are replaced by Triton kernels of one fixed configuration (`exact_kernels.py`:
the matrix products, sums, means, log-sum-exp, softmax, log-softmax); the routed experts of MoE
layers, whose grouped product is not an aten op the mode sees as such, call that file's
`grouped_matmul` themselves (`moe.GroupedExperts`); and attention, which reaches
torch there through FlashAttention's varlen call or the rollout's paged kernel rather than SDPA, is
routed by its callers (`attention_ops.attend`, the rollout's `PagedAttention`) to one kernel for
packed, shared-prompt and paged layouts (`exact_attention.py`). RMSNorm, SwiGLU's silu(gate) * up
and the rotary embedding, which eagerly are several elementwise kernels and a reduction each, are
called by the model code (`layers.py`, the MoE experts) as one fused batch-invariant kernel per call
and direction (`exact_fused.py`, with Triton backward passes of a fixed order), in both engines; and
the training head's entropy pass and logit gradient are fused kernels too (`logprobs._kernels`: the
log-sum-exp stays the one the rollout's sampler takes). Other elementwise CUDA kernels compute
every element by the same code whatever its index, so they run as they are. Nothing is compiled
under the mode: a compiled graph would fuse elementwise work its own way and round differently from
the other engine's; the fused kernels are the same code in both. The rollout's decode still replays
CUDA graphs, captured under the mode: a replay launches the kernels of the eager forward, with the
same bits, without the dispatch mode's Python per op.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


def tree_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over `dim` by a halving tree over the axis zero-padded to a power of two (dim removed)."""
    x = x.movedim(dim, -1)
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        x = F.pad(x, (0, width - n))
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


def _mm(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """[..., M, K] @ [..., K, N] (+ bias) with each output a tree sum over K (in `out_dtype`)."""
    if out_dtype is not None:
        a, b = a.to(out_dtype), b.to(out_dtype)
    product = tree_sum(a.unsqueeze(-1) * b.unsqueeze(-3), dim=-2)
    return product if bias is None else bias + product


def _double(fn):  # noqa: ANN001, ANN202
    """`fn` evaluated in float64 and rounded back (the CPU's vectorised and scalar paths agree there)."""
    return lambda x: fn(x.double()).to(x.dtype)


def _cpu_logsumexp(z: torch.Tensor) -> torch.Tensor:
    m = z.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    s = tree_sum(_double(torch.exp)(z - m), -1)
    return _double(torch.log)(s) + m.squeeze(-1)


@dataclass(frozen=True, slots=True)
class _Numerics:
    """The batch-invariant primitives of one device, from which every replaced op is built."""

    mm: Callable[..., torch.Tensor]
    """(a [..., M, K], b [..., K, N], bias [N] | None, out_dtype=None) -> [..., M, N]"""
    sum_last: Callable[[torch.Tensor], torch.Tensor]
    """x [..., C] -> [...] (the last dim summed)"""
    logsumexp_last: Callable[[torch.Tensor], torch.Tensor]
    """z [..., C] -> [...]"""
    exp: Callable[[torch.Tensor], torch.Tensor]


_CPU = _Numerics(_mm, lambda x: tree_sum(x, -1), _cpu_logsumexp, _double(torch.exp))


@functools.cache
def _cuda() -> _Numerics:
    """The Triton kernels of `exact_kernels.py` (imported on first use: CPU installs lack Triton)."""
    from rlloom.models import exact_kernels as k

    def on_rows(row_op):  # noqa: ANN001, ANN202
        return lambda x: row_op(x.reshape(-1, x.shape[-1])).reshape(x.shape[:-1])

    return _Numerics(k.matmul, on_rows(k.row_sum), on_rows(k.row_logsumexp), torch.exp)


def _logsumexp(ops: _Numerics, z: torch.Tensor, dim: int) -> torch.Tensor:
    return ops.logsumexp_last(z.movedim(dim, -1))


def _dims(x: torch.Tensor, dim: Any) -> list[int]:
    if dim is None or (isinstance(dim, list | tuple) and len(dim) == 0):
        return list(range(x.dim()))
    return sorted(d % x.dim() for d in ([dim] if isinstance(dim, int) else dim))


def _sum(
    ops: _Numerics, x: torch.Tensor, dim: Any, keepdim: bool = False, dtype: torch.dtype | None = None
) -> torch.Tensor:
    dims = _dims(x, dim)
    if dtype is not None:
        x = x.to(dtype)
    moved = x.movedim(dims, list(range(x.dim() - len(dims), x.dim())))
    out = ops.sum_last(moved.reshape(*moved.shape[: x.dim() - len(dims)], -1))
    if keepdim:
        for d in dims:
            out = out.unsqueeze(d)
    return out


_UNARY = {aten.exp.default, aten.log.default, aten.rsqrt.default, aten.sqrt.default, aten.sigmoid.default}
_UNARY |= {aten.silu.default, aten.cos.default, aten.sin.default, aten.tanh.default}


class _ExactOps(TorchDispatchMode):
    """The reductions (and on the CPU the transcendental functions) of the forward, replaced
    (module docstring)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor splits the op into local ops, which come back here
        if any(issubclass(t, FakeTensor) for t in types):
            return func(*args, **kwargs)  # DTensor's shape propagation: no values (nor kernels)
        if not (args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point()):
            return func(*args, **kwargs)  # integer and boolean sums are exact in any order
        cuda = uses_kernels(args[0])
        ops = _cuda() if cuda else _CPU
        if not cuda and func in _UNARY:
            return _double(func)(args[0])
        if not cuda and func is aten.pow.Tensor_Scalar and args[1] != 2:
            return func(args[0].double(), args[1]).to(args[0].dtype)
        if func is aten.mm.default or func is aten.bmm.default:
            return ops.mm(*args)
        if func is aten.mm.dtype:  # torch.mm(out_dtype=): a MoE router's fp32 logits of bf16 operands
            a, b, out_dtype = args
            return ops.mm(a, b, out_dtype=out_dtype)
        if func is aten.addmm.default:
            bias, a, b = args
            beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
            assert beta == 1 and alpha == 1, "exact addmm: only beta = alpha = 1 (F.linear)"
            return ops.mm(a, b, bias) if bias.dim() == 1 else bias + ops.mm(a, b)
        if func is aten.sum.dim_IntList:
            return _sum(ops, *args, **kwargs)
        if func is aten.sum.default:
            return _sum(ops, args[0], None, dtype=kwargs.get("dtype"))
        if func is aten.mean.dim:
            x, dims = args[0], _dims(args[0], args[1])
            count = math.prod(x.shape[d] for d in dims)
            return _sum(ops, *args, **kwargs) / count
        if func is aten.logsumexp.default:
            x, dims = args[0], _dims(args[0], args[1])
            assert len(dims) == 1, "exact logsumexp: one dim"
            out = _logsumexp(ops, x, dims[0])
            return out.unsqueeze(dims[0]) if (len(args) > 2 and args[2]) or kwargs.get("keepdim") else out
        if func is aten._log_softmax.default:
            x, dim = args[0], args[1] % args[0].dim()
            return x - _logsumexp(ops, x, dim).unsqueeze(dim)
        if func is aten._softmax.default:
            x, dim = args[0], args[1] % args[0].dim()
            return ops.exp(x - _logsumexp(ops, x, dim).unsqueeze(dim))
        return func(*args, **kwargs)


def exact_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """`F.scaled_dot_product_attention` (no dropout) over each query's own keys, compacted."""
    assert dropout_p == 0.0, "exact attention has no dropout"
    Lq, Lk = q.shape[-2], k.shape[-2]
    if k.shape[-3] != q.shape[-3]:  # grouped-query attention: each query head's key/value head
        reps = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(reps, dim=-3), v.repeat_interleave(reps, dim=-3)
    allowed = torch.ones(Lq, Lk, dtype=torch.bool, device=q.device)
    if is_causal:
        allowed = torch.tril(allowed)
    if attn_mask is not None:
        assert attn_mask.dtype == torch.bool, "exact attention takes boolean masks"
        allowed = allowed & attn_mask
    shape = (*torch.broadcast_shapes(q.shape[:-2], allowed.shape[:-2]), Lq, Lk)
    allowed = allowed.expand(shape)
    # Each query's visible keys first, in key order (a stable sort of the mask).
    order = torch.sort((~allowed).to(torch.int8), dim=-1, stable=True).indices
    valid = torch.gather(allowed, -1, order)
    k_e = k.unsqueeze(-3).expand(*shape, k.shape[-1])
    v_e = v.unsqueeze(-3).expand(*shape, v.shape[-1])
    k_sel = torch.gather(k_e, -2, order.unsqueeze(-1).expand(*shape, k.shape[-1]))
    v_sel = torch.gather(v_e, -2, order.unsqueeze(-1).expand(*shape, v.shape[-1]))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = tree_sum(q.unsqueeze(-2) * k_sel, dim=-1) * scale
    scores = scores.masked_fill(~valid, float("-inf"))
    m = scores.amax(dim=-1, keepdim=True)
    p = (scores - m).double().exp().to(q.dtype)
    p = torch.where(valid, p, torch.zeros_like(p))
    weighted = torch.where(valid.unsqueeze(-1), p.unsqueeze(-1) * v_sel, torch.zeros_like(v_sel))
    return tree_sum(weighted, dim=-2) / tree_sum(p, dim=-1).unsqueeze(-1)


class _ExactAttention(TorchFunctionMode):
    """SDPA taken before torch picks a kernel, so every caller's attention is `exact_attention`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func is F.scaled_dot_product_attention:
            # On CUDA the callers route attention to exact_attention.py's kernel themselves.
            assert not uses_kernels(args[0]), "exact numerics on CUDA: attention must not reach SDPA"
            return exact_attention(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


_depth = 0
"""How many `exact_numerics()` blocks are open, in any thread. A plain global, not thread-local: a
compiled layer (training's, on CUDA) reads it as a guarded constant, where a thread-local would break
its graph. Only runs with rollout.match_training open one, and then every thread wants it."""


def uses_kernels(x: torch.Tensor) -> bool:
    """Whether exact numerics compute with `x` through the Triton kernels (CUDA tensors), not the
    CPU's tree sums: the one test of the ops here, of attention_ops.attend and of the rollout's
    paged attention (a test on the CPU replaces it to run the kernels in Triton's interpreter)."""
    return x.is_cuda


def is_exact() -> bool:
    """Inside `exact_numerics()`. torch's modes do not reach into the body of a custom op
    (`rlloom::...`), so a caller of one asks this and runs the op's Python body directly; MLA asks it
    to take the rollout's form in training."""
    return _depth > 0


@contextmanager
def exact_numerics(on: bool = True) -> Iterator[None]:
    """Run the block's forward with batch-invariant numerics (module docstring); nothing when off."""
    global _depth
    if not on:
        yield
        return
    _depth += 1
    try:
        with _ExactAttention(), _ExactOps():
            yield
    finally:
        _depth -= 1
