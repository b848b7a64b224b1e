"""rollout.match_training's CUDA kernels (models/exact_kernels.py, models/exact_attention.py) run by
Triton's CPU interpreter (skipped where Triton is absent; `pip install triton` enables them): their
values against torch's (the products, the MoE experts' grouped product, attention with MLA's
narrower values), the same row in another batch bit for bit, and a rollout engine of each family
(dense, Qwen3-MoE, DeepSeek-V3) whose sampled logprobs equal the packed training forward's bit for
bit with every exact op on the kernels.

The interpreter computes tl.dot with numpy's matmul, whose rounding may depend on a row's place in
the tile; the script replaces it with a per-element sum in a fixed order, so what is checked is the
kernels' own logic (tiles, masks, runs, block alignment). That the GPU's tensor-core products are
batch-invariant too is tests/gpu/test_exact_gpu.py's to check. TRITON_INTERPRET must be set before
Triton compiles a kernel, so the checks run in a subprocess."""

from __future__ import annotations

import pytest
import torch
from models_testutil import run_in_triton_interpreter

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="a CPU stand-in: on a GPU tests/gpu/test_exact_gpu.py runs the kernels"
)

FIXED_ORDER_DOT = r"""
import numpy as np
import triton.language as tl
from triton.runtime import interpreter as it

def _f32(h):
    if h.dtype.scalar == tl.bfloat16:
        return (h.data.astype(np.uint32) << 16).view(np.float32)
    return h.data.astype(np.float32)

def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    s = (_f32(a).astype(np.float64)[:, :, None] * _f32(b).astype(np.float64)[None, :, :]).sum(axis=1)
    return it.TensorHandle(s.astype(np.float32) + d.data, d.dtype.scalar)

it.InterpreterBuilder.create_dot = create_dot
"""

KERNELS_SCRIPT = (
    FIXED_ORDER_DOT
    + r"""
import torch
import torch.nn.functional as F
from rlloom.models import exact_kernels as ek
from rlloom.models.exact_attention import Runs, attend_runs, packed_runs

torch.manual_seed(0)
a, w, bias = torch.randn(300, 200), torch.randn(150, 200), torch.randn(150)
full = ek.matmul(a, w.t(), bias)
assert (full - F.linear(a, w, bias)).abs().max() < 1e-4
assert torch.equal(ek.matmul(a[7:8], w.t(), bias), full[7:8]) and torch.equal(ek.matmul(a[5:140], w.t(), bias), full[5:140])
x = torch.randn(3, 5000) * 4
assert (ek.row_logsumexp(x) - x.logsumexp(-1)).abs().max() < 1e-5 and (ek.row_sum(x) - x.sum(-1)).abs().max() < 1e-3
assert torch.equal(ek.row_logsumexp(x[1:2]), ek.row_logsumexp(x)[1:2])

lens = [5, 70, 1, 33]
q, k, v = torch.randn(109, 4, 8), torch.randn(109, 2, 8), torch.randn(109, 2, 8)
cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
out = attend_runs(q, k, v, 0.3, packed_runs(cu, 70, 109))
for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
    ref = F.scaled_dot_product_attention(*(t[s:e].transpose(0, 1) for t in (q, k, v)), is_causal=True, scale=0.3, enable_gqa=True)
    assert (out[s:e] - ref.transpose(0, 1)).abs().max() < 1e-5
s1 = slice(5, 75)
alone = attend_runs(q[s1], k[s1], v[s1], 0.3, packed_runs(torch.tensor([0, 70], dtype=torch.int32), 70, 70))
assert torch.equal(alone, out[s1])
# the 70-token sequence through a block table of 16-slot blocks; unwritten slots hold NaN
table = torch.tensor([7, 3, 11, 0, 15])
slots = (table[:, None] * 16 + torch.arange(16)).flatten()
k_cache, v_cache = torch.full((320, 2, 8), float("nan")), torch.full((320, 2, 8), float("nan"))
k_cache[slots[:70]], v_cache[slots[:70]] = k[s1], v[s1]
for first in (69, 40, 0):
    n = 70 - first
    runs = Runs(torch.tensor([0]), torch.tensor([n]), torch.tensor([0]), torch.tensor([70]), slots, n)
    assert torch.equal(attend_runs(q[5 + first : 75], k_cache, v_cache, 0.3, runs), out[5 + first : 75]), first

# MoE: the experts' grouped product (6 experts, one empty, one past a 128-row tile); a token's row
# alone in its expert and behind other experts' rows
counts = torch.tensor([3, 0, 130, 1, 7, 2])
offsets = counts.cumsum(0).to(torch.int32)
x, w = torch.randn(143, 40), torch.randn(6, 24, 40)
y = ek.grouped_matmul(x, w, offsets)
starts = [0, *offsets[:-1].tolist()]
assert (y - torch.cat([x[s:e] @ w[i].T for i, (s, e) in enumerate(zip(starts, offsets.tolist()))])).abs().max() < 1e-4
alone = ek.grouped_matmul(x[100:101], w, torch.tensor([0, 0, 1, 1, 1, 1], dtype=torch.int32))
behind = ek.grouped_matmul(torch.cat([torch.randn(5, 40), x[100:101]]), w, torch.tensor([5, 5, 6, 6, 6, 6], dtype=torch.int32))
assert torch.equal(alone[0], y[100]) and torch.equal(behind[5], y[100])
# its gradient is the plain product's
import rlloom.models.exact as exact, rlloom.models.moe as moe
xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
moe.exact_expert_linear(xg, wg, offsets).square().sum().backward()
xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
moe._experts_loop(xr, wr, offsets).square().sum().backward()
assert (xg.grad - xr.grad).abs().max() < 1e-3 and (wg.grad - wr.grad).abs().max() < 1e-3
# a router's fp32 logits of bf16 operands (torch.mm's out_dtype, on CUDA) through the exact product
exact.uses_kernels = lambda t: True
a, b = torch.randn(9, 40).bfloat16(), torch.randn(8, 40).bfloat16()
with exact.exact_numerics():
    logits = torch.mm(a, b.t(), out_dtype=torch.float32)
    assert torch.equal(torch.mm(a[3:4], b.t(), out_dtype=torch.float32), logits[3:4])
assert logits.dtype == torch.float32 and (logits - a.float() @ b.float().t()).abs().max() < 1e-4

# MLA's absorbed form: 4 heads against one latent head of 20 channels whose values are its first 16
q, k = torch.randn(79, 4, 20), torch.randn(79, 1, 20)
cu = torch.tensor([0, 9, 79], dtype=torch.int32)
out = attend_runs(q, k, k[..., :16], 0.3, packed_runs(cu, 70, 79))
for s, e in ((0, 9), (9, 79)):
    qs, ks = q[s:e].transpose(0, 1), k[s:e].transpose(0, 1)
    ref = F.scaled_dot_product_attention(qs, ks, ks[..., :16], is_causal=True, scale=0.3, enable_gqa=True)
    assert (out[s:e] - ref.transpose(0, 1)).abs().max() < 1e-5
cache = torch.full((320, 1, 20), float("nan"))
cache[slots[:70]] = k[9:]
for first in (69, 30):
    runs = Runs(torch.tensor([0]), torch.tensor([70 - first]), torch.tensor([0]), torch.tensor([70]), slots, 70 - first)
    assert torch.equal(attend_runs(q[9 + first :], cache, cache[..., :16], 0.3, runs), out[9 + first :]), first
print("ok")
"""
)


def test_kernels_match_torch_and_are_batch_invariant():
    run_in_triton_interpreter(KERNELS_SCRIPT)


ENGINE_SCRIPT = (
    FIXED_ORDER_DOT
    + r"""
import tempfile
import torch
import rlloom.engines.rollout.native.attention as paged
import rlloom.models.attention_ops as attention_ops
import rlloom.models.exact as exact
import rlloom.models.layers as layers
import rlloom.models.moe as moe

# Every exact op on the Triton kernels, as on CUDA (the norms, SwiGLU and rope on the fused ones).
exact.uses_kernels = attention_ops.uses_kernels = paged.uses_kernels = moe.uses_kernels = lambda x: True
layers.uses_kernels = lambda x: True
from rlloom.engines.rollout.base import SamplingParams
from rlloom.engines.rollout.native.engine import NativeEngine
from rlloom.models import from_pretrained
from rlloom.models.logprobs import token_logprobs
from rlloom.models.tiny import write_tiny_model

torch.set_num_threads(1)
import sys
ckpt = write_tiny_model(sys.argv[1], tempfile.mkdtemp(), seed=0, hidden=32, layers=2)
engine = NativeEngine.from_pretrained(ckpt, num_blocks=64, block_size=4, max_model_len=40, seed=0, exact=True)
prompts = [[3, 5, 7, 9, 11], [4, 6, 8, 10, 12, 14, 16, 18, 20]]
completions = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=5, seed=1, ignore_eos=True))
model = from_pretrained(ckpt)
ids, positions, cu, selected, targets, rollout = [], [], [0], [], [], []
for c in completions:
    seq = prompts[c.prompt_index] + c.token_ids
    start = len(ids)
    ids += seq
    positions += range(len(seq))
    cu.append(len(ids))
    selected += range(start + len(prompts[c.prompt_index]) - 1, len(ids) - 1)
    targets += c.token_ids
    rollout += c.logprobs
with torch.no_grad(), exact.exact_numerics():
    hidden = model.hidden_states(torch.tensor(ids), position_ids=torch.tensor(positions),
                                 cu_seqlens=torch.tensor(cu, dtype=torch.int32), max_seqlen=max(map(len, prompts)) + 5)
    train = token_logprobs(hidden[torch.tensor(selected)], model.lm_head_weight, torch.tensor(targets))[0]
assert torch.equal(train, torch.tensor(rollout)), (train - torch.tensor(rollout)).abs().max()
print("ok")
"""
)


@pytest.mark.parametrize("kind", ["tiny-dense", "tiny-moe", "tiny-mla"])
def test_rollout_logprobs_on_the_kernels_equal_the_packed_training_forward(kind):
    """Prefill with shared prompt blocks, decode batches of four, 4-slot cache blocks: every sampled
    token's logprob is the packed forward's (the sequences fit one 64-key block; runs over several,
    decoded and prefilled in chunks, are the kernels test's). MoE: the router, the experts' grouped
    product and the combine; MLA (a DeepSeek-V3, with MoE layers): the absorbed form against the
    latent cache on both sides."""
    run_in_triton_interpreter(ENGINE_SCRIPT, argv=(kind,))
