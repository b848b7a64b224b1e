"""benchmarks/decode_bound.py: the decode steps' bandwidth bound counts the routed experts each step's
tokens chose (each once), not all of them, and leaves out an untied input embedding (issue 48: a
"bound" that counted all 256 experts read at every step printed a ratio of 1.07)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
from bench_moe import TINY, TINY_DEEPSEEK  # noqa: E402
from bench_rollout import run_engine  # noqa: E402
from decode_bound import (  # noqa: E402
    decode_bound_s,
    decode_bytes,
    every_step_bytes,
    experts_hit,
    routed_expert_bytes,
    weight_bytes,
)

from rlloom.engines.rollout.native import NativeEngine, SamplingParams  # noqa: E402
from rlloom.models.checkpoint import build_model  # noqa: E402


def test_decode_bytes_counts_the_experts_hit_and_the_cache_per_step() -> None:
    # 2 steps: 3 then 5 distinct experts of 100 bytes, 7 then 9 cached tokens of 10 bytes, 1000 fixed.
    assert decode_bytes(1000, 100, [3, 5], [7, 9], 10) == (1000 + 300 + 70) + (1000 + 500 + 90)
    assert decode_bytes(1000, 0, [0], [0], 10) == 1000  # a dense model: the weights alone


def test_experts_hit_counts_each_layer_expert_pair_once() -> None:
    routes_RLK = torch.tensor([[[0, 1], [2, 3]], [[1, 0], [2, 5]], [[1, 7], [3, 2]]], dtype=torch.uint8)
    # layer 0: experts {0, 1, 7}; layer 1: {2, 3, 5}
    assert experts_hit(routes_RLK, num_experts=8) == 6


def test_routed_expert_bytes_and_what_every_step_reads() -> None:
    model = build_model(TINY, dtype=torch.float32, device="cpu")
    a = model.args
    one, total = routed_expert_bytes(model)
    # gate, up and down of width moe_intermediate_size, fp32
    assert one == 3 * TINY["hidden_size"] * TINY["moe_intermediate_size"] * 4
    assert total == one * a.moe.num_experts * len(model.moe_layers())
    embedding = TINY["vocab_size"] * TINY["hidden_size"] * 4  # untied: a step gathers its rows only
    assert every_step_bytes(model) == weight_bytes(model) - total - embedding


def test_tiny_deepseek_bound_counts_fewer_bytes_than_every_expert_every_step() -> None:
    """Through run_engine's record of a real run: 2 sequences x 2 routed tokens cannot reach all 8
    experts of the MoE layer at a step, so the bound is below all-weights-every-step and equals the
    count from the completions' routes."""
    torch.manual_seed(0)
    model = build_model(TINY_DEEPSEEK, dtype=torch.float32, device="cpu", fused_projections=True).eval()
    engine = NativeEngine(model, max_model_len=32, num_blocks=16, max_num_seqs=2, eos_token_ids=[])
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    r = run_engine(engine, prompts, SamplingParams(temperature=1.0, max_new_tokens=5, ignore_eos=True))
    steps = r["decode_rows"]
    assert [sorted(pos for _, _, pos in rows) for rows in steps] == [[2 + s, 3 + s] for s in range(1, 5)]
    kv_token = model.args.num_layers * model.args.kv_cache.values_per_token * 4
    one, total = routed_expert_bytes(model)
    bound = decode_bound_s(model, torch.float32, steps, r["completions"], bandwidth=1.0)
    everything = sum(weight_bytes(model) + sum(p + 1 for _, _, p in rows) * kv_token for rows in steps)
    hit = [
        len(
            {
                int(e)
                for c in r["completions"]
                for e in c.routed_experts[len(prompts[c.prompt_index]) + s - 1, 0]
            }
        )
        for s in range(1, 5)
    ]
    assert max(hit) <= 4 < model.args.moe.num_experts
    kv = [sum(p + 1 for _, _, p in rows) for rows in steps]
    assert bound == sum(every_step_bytes(model) + h * one + k * kv_token for h, k in zip(hit, kv))
    assert bound < everything
