"""The Triton paged-decode kernel, run by Triton's CPU interpreter (skipped where Triton is absent).

TRITON_INTERPRET must be set before Triton compiles the kernel, so the checks run in a subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

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
    engine = NativeEngine(models.from_pretrained(path), max_model_len=64, num_blocks=64, block_size=4, max_num_seqs=12)
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


def test_paged_decode_kernel_in_the_interpreter():
    here = Path(__file__).parent
    env = os.environ | {
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]
