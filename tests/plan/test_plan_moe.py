"""The memory model's MoE terms against hand counts, on the single-GPU MoE cases of
benchmarks/bench_plan_memory.py (Qwen3-30B-A3B's width with 4 layers), and the benchmark's tiny MoE
case through the training engine on CPU.

Hand counts: h = 2048, 32 query / 4 KV heads of d = 128 with QK-norm, E = 128 experts of width
f = 768, K = 8 per token, V = 151936, untied head. On one GPU (ep = 1) a decoder layer, experts
included, is one FSDP unit, so L is the whole layer.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from rlloom.models.args import ModelArgs
from rlloom.plan.counts import ROUTING_PER_COPY, model_costs
from rlloom.plan.memory import GB, Hardware, Layout, Workload, estimate

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
from bench_plan_memory import SHAPES, measure  # noqa: E402

h, a, k, d, E, f, K, V = 2048, 32, 4, 128, 128, 768, 8, 151936
ATTENTION = 2 * h * a * d + 2 * h * k * d + h + 2 * d  # q, o, k, v, input norm, q/k norms
DENSE = ATTENTION + E * h + h  # + router, ffn norm
EXPERTS = E * 3 * h * f
LAYER = DENSE + EXPERTS
ROOT = 2 * V * h + h  # embedding, untied head, final norm
P = 4 * LAYER + ROOT
ACT = (2 * h + (a * d + 2 * k * d) + (a * d + k * d) + 2 * a * d) + (2 * h + 2 * E + K * (2 * h + 3 * f + 15))


def costs():
    return model_costs(ModelArgs.from_hf_config(SHAPES["qwen3-30b-a3b-4l"]))


def predicted(tokens: int, recompute: str, offload: float, micro_batches: int):
    work = Workload(
        max_tokens_per_gpu=tokens,
        recompute=recompute,
        response_fraction=0.75,
        micro_batches=micro_batches,
        colocated_rollout=False,
    )
    return estimate(costs(), Layout(offload_fraction=offload), Hardware(gpus=1, gpu_memory_gb=80), work)


def test_layer_parameters_and_activations_by_hand():
    c = costs()
    assert ROUTING_PER_COPY == 15  # expert id, sorted position, token index (int64), fp32 + bf16 weight
    assert [(x.dense_params, x.expert_params, x.act_none, x.is_moe) for x in c.layers] == [
        (DENSE, EXPERTS, ACT, True)
    ] * 4
    assert c.total_params == P == 3_114_814_464  # what build_model allocates (meta device)
    assert (c.num_experts, c.top_k, c.tied) == (E, K, False)


def test_routed_copies_scale_with_top_k():
    base = SHAPES["qwen3-30b-a3b-4l"]
    acts = [
        model_costs(ModelArgs.from_hf_config(base | {"num_experts_per_tok": top_k})).layers[0].act_none
        for top_k in (4, 8)
    ]
    assert acts[1] - acts[0] == 4 * (2 * h + 3 * f + ROUTING_PER_COPY)


def test_one_micro_batch_peaks_at_the_root_reduce():
    # every fp32 shard and gradient, the moments, and the root's single-rank reduce: input + divide
    est = predicted(8192, "full", 0.0, 1)
    assert est.peak_phase == "reduce"
    assert est.gpu_memory_gb == pytest.approx((4 * P + 4 * P + 8 * P + 2 * 4 * ROOT) / GB)


def test_two_micro_batches_peak_at_the_moe_layer_reduce():
    # shards, gathered bf16 root, the prefetched layer, the first micro-batch's fp32 gradients, the
    # head's bf16 gradient, the layer's reduce (input, single-rank divide, output before the add),
    # half the moments, and the four layers' inputs kept by full checkpointing
    est = predicted(8192, "full", 0.5, 2)
    assert est.peak_phase == "layer reduce"
    want = 4 * P + 2 * ROOT + 2 * LAYER + 4 * P + 2 * V * h + 12 * LAYER + 4 * P + 2 * 8192 * 4 * h
    assert est.gpu_memory_gb == pytest.approx(want / GB)


def test_without_checkpointing_the_moe_activations_set_the_layer_peak():
    # all four layers' saved activations, the layer in backward and the prefetched one in bf16 with
    # its bf16 gradient and the previous layer's fp32 reduce input, gradient temporaries (half a
    # layer's activations), the head's bf16 gradient
    t = 16384
    est = predicted(t, "none", 0.5, 1)
    assert est.peak_phase == "layers"
    want = 4 * P + 2 * ROOT + 4 * LAYER + 6 * LAYER + 2 * V * h + 4 * P + 2 * t * ACT * (4 + 0.5)
    assert est.gpu_memory_gb == pytest.approx(want / GB)


def test_tiny_moe_case_trains_through_the_engine_on_cpu():
    # the benchmark's --tiny MoE case: two micro-batches, half the optimizer on the host, no AC
    assert math.isnan(measure(SHAPES["tiny-moe"], 512, "off", 0.5, 2, torch.device("cpu"), False))
