"""rollout.match_training's fused CUDA kernels (models/exact_fused.py: RMSNorm, SwiGLU's
silu(gate) * up, the rotary embedding) run by Triton's CPU interpreter (skipped where Triton is
absent): values and gradients against the torch formulas of `layers.py`, a row's bits whatever
batch it is in, RMSNorm's weight gradient the same bits on a repeat, and one layer called as the
rollout calls it (fused projections, a decode batch) and as training does (separate projections,
packed rows, with gradients) giving a token the same bits. tests/gpu/test_exact_gpu.py runs them
on a GPU. TRITON_INTERPRET must be set before Triton compiles a kernel: the checks run in a
subprocess."""

from __future__ import annotations

import pytest
import torch
from models_testutil import run_in_triton_interpreter
from test_exact_kernels import FIXED_ORDER_DOT

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="a CPU stand-in: on a GPU tests/gpu/test_exact_gpu.py runs the kernels"
)

PRELUDE = r"""
import torch
import torch.nn.functional as F
import rlloom.models.exact as exact
import rlloom.models.layers as layers
from rlloom.models import exact_fused as ef

torch.manual_seed(0)

def close(a, b, tol):
    err = (a.float() - b.float()).abs().max().item()
    assert err <= tol * max(b.float().abs().max().item(), 1.0), err

def grads(fn, *leaves):
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    out = fn(*leaves)
    out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(out.dtype))
    return out, [t.grad for t in leaves]
"""

KERNELS_SCRIPT = (
    PRELUDE
    + r"""
norm = layers.RMSNorm(40, 1e-6)
with torch.no_grad():
    norm.weight.copy_(torch.randn(40))
for dtype in (torch.float32, torch.bfloat16):
    x, w = (torch.randn(70, 40) * 3).to(dtype), norm.weight.detach().to(dtype)
    ref, ref_grads = grads(lambda x, w: w * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype), x, w)
    out, out_grads = grads(lambda x, w: ef.rms_norm(x, w, 1e-6), x, w)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert out.dtype == dtype
    close(out, ref, tol)
    for got, want in zip(out_grads, ref_grads):
        close(got, want, tol * 5)
    # a row alone, among others, at another place
    alone = ef.rms_norm(x[9:10], w, 1e-6)
    mixed = ef.rms_norm(torch.cat([torch.randn(3, 40).to(dtype), x[9:10]]), w, 1e-6)
    assert torch.equal(alone[0], out[9]) and torch.equal(mixed[3], out[9])
    # the weight gradient over rows past one backward block: the same bits on a repeat
    xs = torch.randn(3 * ef.NORM_BWD_ROWS + 5, 40).to(dtype)
    repeat = [grads(lambda x, w: ef.rms_norm(x, w, 1e-6), xs, w)[1][1] for _ in range(2)]
    assert torch.equal(repeat[0], repeat[1])
    _, ref_w = grads(lambda x, w: w * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype), xs, w)
    close(repeat[0], ref_w[1], tol * 5)
# an fp32 weight over bf16 rows: torch's promotion (fp32 out)
xb = torch.randn(5, 40).bfloat16()
assert ef.rms_norm(xb, norm.weight.detach(), 1e-6).dtype == torch.float32

# silu(gate) * up, the gate and up as the rollout's halves of one fused product (row stride 2C)
gu = torch.randn(33, 2 * 24)
gate, up = gu.split(24, dim=-1)
out, out_grads = grads(lambda g, u: ef.silu_mul(g, u), gate, up)
ref, ref_grads = grads(lambda g, u: F.silu(g) * u, gate, up)
close(out, ref, 1e-6)
for got, want in zip(out_grads, ref_grads):
    close(got, want, 1e-5)
assert torch.equal(ef.silu_mul(gate, up), ef.silu_mul(gate.contiguous(), up.contiguous()))
assert torch.equal(ef.silu_mul(gate[4:5], up[4:5])[0], out[4])

# rope, plain and interleaved, on a strided slice of heads (MLA's q_pe) and a single shared head
emb = torch.randn(17, 4)
cos, sin = torch.cat([emb, emb], -1).cos(), torch.cat([emb, emb], -1).sin()
q = torch.randn(17, 3, 12)[..., 4:]
for interleaved in (False, True):
    for x in (q, torch.randn(17, 1, 8)):
        def plain(x):
            rot = x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2) if interleaved else x
            c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
            return rot * c + layers._rotate_half(rot) * s
        out, (g,) = grads(lambda x: ef.rope(x, cos, sin, interleaved), x)
        ref, (g_ref,) = grads(plain, x)
        close(out, ref, 1e-6)
        close(g, g_ref, 1e-6)
        assert torch.equal(ef.rope(x[6:7], cos[6:7], sin[6:7], interleaved)[0], out[6])
# cos/sin broadcast over a batch dim: x [B, T, H, D], cos [T, D]
xb = torch.randn(2, 17, 3, 8)
close(ef.rope(xb, cos, sin, False), xb * cos.unsqueeze(-2) + layers._rotate_half(xb) * sin.unsqueeze(-2), 1e-6)

# the logprob head's statistics under the numerics: logp and lse the bits of the torch formula on
# the numerics' kernels (the sampler's), the entropy's fused sum per row, alone or in a batch
from rlloom.models import logprobs
exact.uses_kernels = lambda x: True
logits, targets = (torch.randn(6, 3000) * 3).bfloat16(), torch.randint(0, 3000, (6,))
for inv_temp in (1.0, 1 / 0.7):
    with exact.exact_numerics():
        got = ef.chunk_stats(logits, targets, inv_temp, True)
        want = logprobs.chunk_stats(logits, targets, inv_temp, True)
        alone = ef.chunk_stats(logits[4:5], targets[4:5], inv_temp, True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    close(got[2], want[2], 1e-5)
    assert all(torch.equal(a[0], g[4]) for a, g in zip(alone, got))

# training's tensor parallelism hands a norm DTensors (tokens sharded, the weight replicated): the
# kernel runs on the local rows, the output keeps the placement, the weight's gradient is a Partial
import os
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29731")
dist.init_process_group("gloo", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
layers.uses_kernels = lambda x: True
x, w = torch.randn(10, 40), torch.randn(40)
plain, (gx, gw) = grads(lambda x, w: layers._exact_rms_norm(x, w, 1e-6), x, w)
wd = torch.nn.Parameter(distribute_tensor(w, mesh, [Replicate()]))
xd = DTensor.from_local(x.clone().requires_grad_(), mesh, [Shard(0)])
with exact.exact_numerics():
    out = layers._exact_rms_norm(xd, wd, 1e-6)
assert isinstance(out, DTensor) and out.placements == (Shard(0),) and torch.equal(out.to_local(), plain)
out.to_local().backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape))
assert wd.grad.placements == (Partial(),) and torch.equal(wd.grad.to_local(), gw)
dist.destroy_process_group()
print("ok")
"""
)


def test_fused_kernels_match_torch_and_are_batch_invariant():
    run_in_triton_interpreter(KERNELS_SCRIPT)


LAYER_SCRIPT = (
    FIXED_ORDER_DOT
    + PRELUDE
    + r"""
import tempfile
from rlloom.models import from_pretrained
from rlloom.models.tiny import write_tiny_model

launched = []
for name in ("rms_norm", "silu_mul", "rope"):
    fn = getattr(ef, name)
    setattr(ef, name, lambda *a, _fn=fn, _name=name: launched.append(_name) or _fn(*a))
exact.uses_kernels = layers.uses_kernels = lambda x: True
ckpt = write_tiny_model("tiny-dense", tempfile.mkdtemp(), seed=0, hidden=32, layers=1)
train, rollout = from_pretrained(ckpt), from_pretrained(ckpt, fused_projections=True)
(block_t,), (block_r,) = train.layers, rollout.layers
attn_t, attn_r = block_t.attention, block_r.attention
h = train.tok_embeddings(torch.randint(3, 60, (11,))).detach()
cos, sin = train.rope(torch.arange(11), h.dtype)

def training(x):  # packed rows, separate projections
    q = attn_t.q_norm(attn_t.wq(block_t.attention_norm(x)).unflatten(-1, (4, 8)))
    return layers.apply_rope(q, cos, sin), block_t.feed_forward(block_t.ffn_norm(x))

def rollout_decode(x, row):  # one row, the fused q/k/v and gate/up products, no gradient
    q = attn_r.wqkv.forward_parts(block_r.attention_norm(x))[0].unflatten(-1, (4, 8))
    return layers.apply_rope(attn_r.q_norm(q), cos[row : row + 1], sin[row : row + 1]), block_r.feed_forward(block_r.ffn_norm(x))

with exact.exact_numerics():
    x = h.clone().requires_grad_()
    q_t, mlp_t = training(x)
    with torch.no_grad():
        q_r, mlp_r = rollout_decode(h[7:8], 7)
    assert torch.equal(q_r[0], q_t[7]) and torch.equal(mlp_r[0], mlp_t[7])
(q_t.square().sum() + mlp_t.square().sum()).backward()
assert torch.isfinite(x.grad).all() and block_t.ffn_norm.weight.grad is not None and attn_t.q_norm.weight.grad is not None
assert set(launched) == {"rms_norm", "silu_mul", "rope"}, launched
# and the same values as the torch formulas outside the mode
q_ref, mlp_ref = training(h)
close(q_t, q_ref, 1e-5)
close(mlp_t, mlp_ref, 1e-5)
print("ok")
"""
)


def test_a_layer_called_as_rollout_and_as_training_gives_the_same_bits():
    """The attention's norm, q projection, q-norm and rope, and the SwiGLU MLP after its norm: the
    rollout's form (fused q/k/v and gate/up products, one decode row, no gradient) and training's
    (separate projections, packed rows, with a gradient) give the row the same bits."""
    run_in_triton_interpreter(LAYER_SCRIPT)


AC_SCRIPT = (
    FIXED_ORDER_DOT
    + PRELUDE
    + r"""
import tempfile
import rlloom.engines.rollout.native.attention as paged
import rlloom.models.attention_ops as attention_ops
import rlloom.models.moe as moe
from rlloom.models import from_pretrained
from rlloom.models.model import unwrapped_name
from rlloom.models.tiny import write_tiny_model
from rlloom.parallel.ac import apply_ac

exact.uses_kernels = attention_ops.uses_kernels = paged.uses_kernels = moe.uses_kernels = lambda x: True
layers.uses_kernels = lambda x: True
ckpt = write_tiny_model("tiny-dense", tempfile.mkdtemp(), seed=0, hidden=32, layers=1)
ids, cu = torch.randint(3, 60, (12,)), torch.tensor([0, 5, 12], dtype=torch.int32)
positions = torch.tensor([*range(5), *range(7)])

def weight_grads(ac):
    model = from_pretrained(ckpt)
    if ac:
        assert apply_ac(model, "full", keep_numerics=True) == 1
    with exact.exact_numerics():
        hidden = model.hidden_states(ids, position_ids=positions, cu_seqlens=cu, max_seqlen=7)
    hidden.square().sum().backward()
    return {unwrapped_name(n): p.grad for n, p in model.named_parameters() if p.grad is not None}

plain, checkpointed = weight_grads(False), weight_grads(True)
assert plain.keys() == checkpointed.keys() and all(torch.equal(plain[n], checkpointed[n]) for n in plain)
print("ok")
"""
)


def test_activation_checkpointing_recomputes_under_the_forwards_numerics():
    """train.activation_checkpointing with rollout.match_training: the recomputation in backward
    runs the fused kernels as the forward did (non-reentrant checkpointing checks the tensors the
    forward saved), and the weight gradients are the bits of the run without checkpointing."""
    run_in_triton_interpreter(AC_SCRIPT)
