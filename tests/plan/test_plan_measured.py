"""The memory model against training peaks measured on an H200 (benchmarks/bench_plan_memory.py).

Each case is a dense Qwen3 shape trained by rlloom's engine on one GPU (torch 2.11, CUDA 13,
torch.compile on): `python benchmarks/bench_plan_memory.py --case MODEL:TOKENS:AC:OFFLOAD[:MICRO_BATCHES]`
prints the measured `torch.cuda.max_memory_allocated` of the second step (GB = 2**30 bytes). The
phase is where the CUDA allocator's trace put the peak (docs/plan.md, section 6). The issue asks for
10%; the model is held to 2%, so a regression in any term shows.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
from bench_plan_memory import SHAPES, parse_case, predict  # noqa: E402

# case: (GB measured on one H200, peak phase seen in the allocator trace). Measured on 2026-11-23
# with the engine before its non-finite guard; the guard's trial adds at most ~0.2 GB at the step
# (a phase that peaks in none of these cases).
MEASURED = {
    "qwen3-0.6b:8192:off:0": (20.53, "head"),
    "qwen3-1.7b:16384:full:0": (28.03, "reduce"),
    "qwen3-1.7b:16384:full:1.0": (15.20, "reduce"),
    "qwen3-4b:8192:full:0.5": (48.10, "reduce"),
    "qwen3-1.7b:8192:off:0.5": (33.28, "head"),
    "qwen3-1.7b:16384:full:1.0:2": (20.14, "head"),
    "qwen3-1.7b:8192:off:0.5:2": (39.69, "head"),
}


@pytest.mark.parametrize("case", list(MEASURED))
def test_predicted_peak_is_within_2_percent_of_the_measured_one(case):
    model, tokens, ac, offload, micro_batches = parse_case(case)
    measured, phase = MEASURED[case]
    predicted, parts = predict(SHAPES[model], tokens, ac, offload, micro_batches, 139.8, True)
    assert predicted == pytest.approx(measured, rel=0.02), parts
    assert parts.endswith(f"at {phase}")


# MoE: the Qwen3-30B-A3B width with 4 of its layers on one H100 (80 GB), 2026-11-23,
# `python benchmarks/bench_plan_memory.py --moe`. The peak phase was not traced on the device; the
# model is held to 5% (the 10% the issue asks, with room to see a regression).
MEASURED_MOE = {
    "qwen3-30b-a3b-4l:8192:full:0": 52.29,
    "qwen3-30b-a3b-4l:8192:full:1.0": 29.07,
    "qwen3-30b-a3b-4l:8192:full:0.5:2": 44.88,
    "qwen3-30b-a3b-4l:16384:off:0.5": 41.00,
}


@pytest.mark.parametrize("case", list(MEASURED_MOE))
def test_moe_predicted_peak_is_within_5_percent_of_the_measured_one(case):
    model, tokens, ac, offload, micro_batches = parse_case(case)
    predicted, parts = predict(SHAPES[model], tokens, ac, offload, micro_batches, 79.2, True)
    assert predicted == pytest.approx(MEASURED_MOE[case], rel=0.05), parts
