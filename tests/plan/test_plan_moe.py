"""The memory model's MoE terms against hand counts, on the single-GPU MoE cases of
benchmarks/bench_plan_memory.py (Qwen3-30B-A3B's width with 4 layers); the per-copy activation count
against what torch.compile's partitioner keeps for backward of the MoE layer's CUDA path (grouped
GEMMs, run on CPU); and the benchmark's tiny MoE case through the training engine on CPU.

Hand counts: h = 2048, 32 query / 4 KV heads of d = 128 with QK-norm, E = 128 experts of width
f = 768, K = 8 per token, V = 151936, untied head. On one GPU (ep = 1) a decoder layer, experts
included, is L. One GPU runs without FSDP (a bf16 copy of every parameter while it computes) unless
it offloads its optimizer (then FSDP2 on one rank, a decoder layer with its experts one unit).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from rlloom.models.args import ModelArgs, MoEArgs
from rlloom.models.moe import MoE, _grouped_linear
from rlloom.plan.counts import ROUTING_PER_COPY, model_costs
from rlloom.plan.inputs import Hardware, Layout, Workload
from rlloom.plan.memory import GB, estimate
from rlloom.plan.phases import _head_chunk_tokens

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


def _compiled_saved_per_token(top_k: int, hidden: int = 256, width: int = 128, tokens: int = 512) -> float:
    """bf16 elements per token that the compiled MoE layer keeps for backward (what the backward
    graph takes besides gradients and parameters), with torch.compile's min-cut partitioner."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    torch._dynamo.reset()
    torch.manual_seed(0)
    # 4 experts: the slope is the same as with 8 (905 vs 906), and tracing the per-expert counts'
    # symbolic shapes takes half the time
    moe = MoE(hidden, MoEArgs(num_experts=4, top_k=top_k, intermediate_size=width)).to(torch.bfloat16)
    moe.experts._linear = lambda xs: _grouped_linear  # the CUDA path: torch._grouped_mm runs on CPU too
    param_shapes = {tuple(p.shape) for p in moe.parameters()} | {
        tuple(p.shape[::-1]) for p in moe.parameters()
    }
    saved = []

    def backward_compiler(gm, example_inputs):
        for n in gm.graph.nodes:
            v = n.meta.get("val")
            if n.op == "placeholder" and not n.name.startswith("tangents") and isinstance(v, torch.Tensor):
                if tuple(v.shape) not in param_shapes and v.dim() < 3:
                    saved.append(v.numel() * v.element_size())
        return make_boxed_func(gm)

    def backend(gm, example_inputs):
        return aot_module_simplified(
            gm,
            example_inputs,
            fw_compiler=lambda g, _: make_boxed_func(g),
            bw_compiler=backward_compiler,
            partition_fn=min_cut_rematerialization_partition,
        )

    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
    torch.compile(moe, backend=backend, fullgraph=True)(x).sum().backward()
    torch._dynamo.reset()
    return sum(saved) / 2 / tokens


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="needs torch._grouped_mm")
def test_each_routed_copy_costs_what_the_compiled_layer_keeps():
    # two more copies a token: the permuted input, gate, up, product and expert output (2h + 3f) and
    # the routing bookkeeping; the partitioner keeps the fp32 routing weight or recomputes it from
    # the scores (a difference of 2 per copy), so the slope is held to 1%
    per_copy = (_compiled_saved_per_token(4) - _compiled_saved_per_token(2)) / 2
    assert per_copy == pytest.approx(2 * 256 + 3 * 128 + ROUTING_PER_COPY, rel=0.01)


def test_one_micro_batch_peaks_at_the_last_layers_backward():
    # one GPU runs without FSDP: fp32 masters, a bf16 copy of every parameter, every fp32 gradient
    # but the embedding's (it comes last), the last layer's bf16 gradients, the moments; the last
    # layer's input and its recomputed activations with their gradients
    t = 8192
    est = predicted(t, "full", 0.0, 1)
    assert est.peak_phase == "last layer"
    want = 4 * P + 2 * P + 4 * (P - V * h) + 2 * LAYER + 8 * P + 2 * t * h + 2 * t * ACT * 1.5
    assert est.gpu_memory_gb == pytest.approx(want / GB)


def test_two_micro_batches_peak_at_the_head():
    # masters and copies, the first micro-batch's fp32 gradients, the head's fp32 weight-gradient
    # accumulator, the moments, the four layers' inputs kept by full checkpointing, the final
    # norm's fp32 input and bf16 output, the selected hidden states and their gradient, the logits chunks
    t, selected = 8192, 0.75 * 8192
    est = predicted(t, "full", 0.0, 2)
    assert est.peak_phase == "head"
    chunks = _head_chunk_tokens(selected, Workload(max_tokens_per_gpu=t).logprob_chunk_tokens)
    want = 6 * P + 4 * P + 4 * V * h + 8 * P + 2 * t * 4 * h + 6 * t * h + 4 * selected * h + 2 * chunks * V
    assert est.gpu_memory_gb == pytest.approx(want / GB)


def test_without_checkpointing_the_moe_activations_set_the_layer_peak():
    # masters and copies, the head's fp32 gradient, the layer's bf16 gradients and their fp32 casts,
    # the moments, all four layers' saved activations and gradient temporaries (half a layer's)
    t = 16384
    est = predicted(t, "none", 0.0, 1)
    assert est.peak_phase == "layers"
    want = 6 * P + 4 * V * h + 6 * LAYER + 8 * P + 2 * t * ACT * (4 + 0.5)
    assert est.gpu_memory_gb == pytest.approx(want / GB)


def test_with_offload_two_micro_batches_peak_at_the_moe_layer_reduce():
    # optimizer offload keeps FSDP2 on one GPU: shards, gathered bf16 root, the prefetched layer,
    # the first micro-batch's fp32 gradients, the head's bf16 gradient, the layer's reduce (input,
    # single-rank divide, output before the add), half the moments, and the four layers' inputs
    est = predicted(8192, "full", 0.5, 2)
    assert est.peak_phase == "layer reduce"
    want = 4 * P + 2 * ROOT + 2 * LAYER + 4 * P + 2 * V * h + 12 * LAYER + 4 * P + 2 * 8192 * 4 * h
    assert est.gpu_memory_gb == pytest.approx(want / GB)


def test_with_offload_without_checkpointing_the_last_layer_peaks():
    # FSDP2 on one GPU: the shards, the gathered root, the last layer in bf16; the fp32 gradients of
    # the three other layers (the root's are reduced at the end), the head's bf16 gradient, the
    # layer's bf16 gradients and the previous layer's fp32 reduce input; half the moments; the last
    # layer's saved activations and its gradient temporaries (half a layer's)
    t = 16384
    est = predicted(t, "none", 0.5, 1)
    assert est.peak_phase == "last layer"
    want = 4 * P + 2 * ROOT + 2 * LAYER + 4 * (P - ROOT) + 2 * V * h + 6 * LAYER + 4 * P + 2 * t * ACT * 1.5
    assert est.gpu_memory_gb == pytest.approx(want / GB)


def test_tiny_moe_case_trains_through_the_engine_on_cpu():
    # a --tiny MoE case of the benchmark: two micro-batches, half the optimizer on the host, full AC
    assert math.isnan(measure(SHAPES["tiny-moe"], 512, "full", 0.5, 2, torch.device("cpu"), False))
