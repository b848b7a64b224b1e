"""The memory model against training peaks measured on an H200 (benchmarks/bench_plan_memory.py).

Each case is a dense Qwen3 shape trained by rlloom's engine on one GPU (torch 2.11, CUDA 13,
torch.compile on): `python benchmarks/bench_plan_memory.py --case MODEL:TOKENS:AC:OFFLOAD[:MICRO_BATCHES]`
prints the measured `torch.cuda.max_memory_allocated` of the second step (GB = 2**30 bytes). The
issue asks for 10%; the model is held to 2%, so a regression in any term shows.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
from bench_plan_memory import SHAPES, parse_case, predict  # noqa: E402

# case: GB measured on one H200. Without optimizer offload one GPU runs without FSDP
# (rlloom/parallel/mixed_precision.py): measured 2026-11-24. With offload it keeps FSDP2 on one rank:
# measured 2026-11-23, the phase of each peak traced then (docs/plan.md, section 6).
MEASURED = {
    "qwen3-0.6b:8192:off:0": 21.35,
    "qwen3-0.6b:8192:full:0": 11.25,
    "qwen3-1.7b:16384:full:0": 29.93,
    "qwen3-1.7b:16384:full:1.0": 15.20,
    "qwen3-4b:8192:full:0.5": 48.10,
    "qwen3-1.7b:8192:off:0.5": 33.28,
    "qwen3-1.7b:16384:full:1.0:2": 20.14,
    "qwen3-1.7b:8192:off:0.5:2": 39.69,
}


@pytest.mark.parametrize("case", list(MEASURED))
def test_predicted_peak_is_within_2_percent_of_the_measured_one(case):
    model, tokens, ac, offload, micro_batches = parse_case(case)
    predicted, parts = predict(SHAPES[model], tokens, ac, offload, micro_batches, 139.8, True)
    assert predicted == pytest.approx(MEASURED[case], rel=0.02), parts


# MoE: the Qwen3-30B-A3B width with 4 of its layers, `python benchmarks/bench_plan_memory.py --moe`:
# without offload on one H200 on 2026-11-24 (no FSDP), with offload on one H100 on 2026-11-23
# (FSDP2 on one rank). The peak phase was not traced on the device; the model is held to 5% (the
# 10% the issue asks, with room to see a regression).
MEASURED_MOE = {
    "qwen3-30b-a3b-4l:8192:full:0": 52.87,
    "qwen3-30b-a3b-4l:8192:full:1.0": 29.07,
    "qwen3-30b-a3b-4l:8192:full:0.5:2": 44.88,
    "qwen3-30b-a3b-4l:16384:off:0.5": 41.00,
}


@pytest.mark.parametrize("case", list(MEASURED_MOE))
def test_moe_predicted_peak_is_within_5_percent_of_the_measured_one(case):
    model, tokens, ac, offload, micro_batches = parse_case(case)
    predicted, parts = predict(SHAPES[model], tokens, ac, offload, micro_batches, 139.8, True)
    assert predicted == pytest.approx(MEASURED_MOE[case], rel=0.05), parts
