"""The Triton kernels (paged decode with and without shared prefixes, the chunked sampler), run by
Triton's CPU interpreter (skipped where Triton is absent; `pip install triton` enables them on CPU).

TRITON_INTERPRET must be set before Triton compiles the kernel, so the checks run in a subprocess.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rollout_testutil import run_in_triton_interpreter

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="a CPU stand-in: on a GPU the compiled kernels run in tests/gpu (the Triton interpreter of the "
    "GPU machine's torch 2.11 failed both tests, the sampler's on a loop bounded by program ids; "
    "Triton 3.9's passes them)",
)

SCRIPT = r"""
import tempfile, torch
from rollout_testutil import prompts, save, tiny_dense
import rlloom.models as models
from rlloom.engines.rollout.native import NativeEngine, SamplingParams
from rlloom.engines.rollout.native.paged_decode import decode_kernel_works
from test_rollout_engine import EagerGraphs

for shape in [(4, 2, 16, 16), (16, 8, 128, 128), (3, 3, 24, 16)]:
    assert decode_kernel_works(torch.device("cpu"), torch.float32, *shape), shape
path = save(tiny_dense(seed=0), tempfile.mkdtemp())
batch = prompts(5, max_len=20, seed=1)
params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=3)
outs = []
for kernel, graphs in ((False, False), (True, False), (True, True)):
    engine = NativeEngine(models.from_pretrained(path, fused_projections=True), max_model_len=64, num_blocks=64, block_size=4, max_num_seqs=12)
    runner = engine.runner
    runner.backend.use_decode_kernel = kernel
    if graphs:  # padded batches (scratch-block rows) through the static graph buffers
        runner.graphs = EagerGraphs(engine.model, runner.backend, max_num_seqs=12,
                                    max_blocks_per_seq=runner.max_blocks_per_seq, scratch_block=runner.num_blocks)
    outs.append(engine.generate(batch, params))
for other in outs[1:]:
    for a, b in zip(outs[0], other):
        assert a.token_ids == b.token_ids, (a, b)
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
print("ok")
"""


SAMPLER_SCRIPT = r"""
import torch
from rlloom.engines.rollout.native.sampler import Sampler, SamplingRows, noise_key

R, V = 6, 5000
logits = torch.randn(R, V, generator=torch.Generator().manual_seed(0)) * 3
logits[5, 100] = logits[5, 4000] = 50.0  # a tie across chunks: the first index wins, as torch.argmax
temps = [1.0, 0.7, 0.0, 1.3, 1.0, 0.0]
keys = [noise_key(3, r, 7) for r in range(R)]
rows = SamplingRows.build(temps, [1.0] * R, [-1] * R, keys, torch.device("cpu"))
tokens, logprobs = Sampler._fused(logits, rows.temperature_R, torch.tensor(keys), chunk=1024)
sampler = Sampler(torch.device("cpu"), 0)
noise = sampler._log_noise(logits, keys, torch.tensor(keys))  # the same Triton noise
z = logits / torch.where(rows.temperature_R == 0, 1.0, rows.temperature_R)[:, None]
want = torch.where(rows.temperature_R == 0, logits.argmax(-1), (z - noise).argmax(-1))
assert tokens.tolist() == want.tolist() and tokens[5] == 100, (tokens, want)
assert (logprobs - torch.log_softmax(z, -1).gather(1, want[:, None])[:, 0]).abs().max() < 1e-5

# The noise is Exponential(1) in each of Philox's four output lanes, and the lanes are independent
# (a lane mix-up, e.g. every index of a quad taking output 0, would correlate them perfectly).
R, V = 64, 4099
E = sampler._log_noise(torch.zeros(R, V), [None] * R, torch.tensor([noise_key(9, r, 0) for r in range(R)])).exp()
lanes = [E[:, i : V - 3 : 4].flatten() for i in range(4)]
for lane in lanes:
    assert abs(lane.mean() - 1) < 0.02 and abs((lane > 1).float().mean() - 0.3679) < 0.01
corr = torch.corrcoef(torch.stack(lanes))
assert (corr - torch.eye(4)).abs().max() < 0.02, corr

# Sampled frequencies match softmax(logits / T) (fresh keys per row, the RL case).
R, V, T = 3000, 6, 0.8
row = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -3.0])
keys = torch.tensor([noise_key(11, r, 0) for r in range(R)])
tokens, _ = Sampler._fused(row.expand(R, V).contiguous(), torch.full((R,), T), keys, chunk=1024)
p = torch.softmax(row / T, -1)
freq = torch.bincount(tokens, minlength=V).float() / R
assert ((freq - p).abs() <= 5 * (p * (1 - p) / R).sqrt() + 1e-3).all(), (freq, p)
print("ok")
"""


def test_paged_decode_kernel_in_the_interpreter():
    # decode_kernel_works includes shared-prefix groups; n=2 samples make the engine form groups.
    run_in_triton_interpreter(SCRIPT, Path(__file__).parent)


def test_chunked_sampler_in_the_interpreter():
    run_in_triton_interpreter(SAMPLER_SCRIPT)
