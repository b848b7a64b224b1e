"""The memory model against published numbers: parameter counts, and the components it must cover."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from rlloom.models.args import ModelArgs
from rlloom.plan.counts import model_costs
from rlloom.plan.inputs import Hardware, Layout, Workload
from rlloom.plan.memory import estimate
from rlloom.plan.published import CONFIG_DIR

CONFIGS = CONFIG_DIR  # the published configs rlloom ships


def costs_of(name: str, **overrides):
    raw = json.loads((CONFIGS / name / "config.json").read_text()) | overrides
    return model_costs(ModelArgs.from_hf_config(raw))


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("qwen3-0.6b", 596_049_920),  # tied head
        ("qwen3-8b", 8_190_735_360),
        ("qwen3-30b-a3b", 30_532_122_624),
        ("qwen3-235b-a22b", 235_093_634_560),
    ],
)
def test_parameter_counts_match_published_totals(name, params):
    assert costs_of(name).total_params == params


def test_deepseek_v3_counts_mla_moe_shared_and_dense_layers_without_mtp():
    costs = costs_of("deepseek-v3")
    assert abs(costs.total_params / 671e9 - 1) < 2e-3  # 671B main model; the 14B MTP module is not trained
    assert [c.is_moe for c in costs.layers] == [False] * 3 + [True] * 58  # first_k_dense_replace=3
    dense, moe = costs.layers[0], costs.layers[3]
    assert dense.expert_params == 0 and moe.expert_params == 256 * 3 * 7168 * 2048
    # MLA: q_a/q_b, kv_a/kv_b, o and their norms; the dense MLP is 3 x 7168 x 18432
    mla = 7168 * 1536 + 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 + 512 * 128 * 256 + 128 * 128 * 7168 + 7168
    assert dense.dense_params == mla + 3 * 7168 * 18432 + 7168
    assert moe.dense_params == mla + 256 * 7168 + 256 + 3 * 7168 * 2048 + 7168  # router, bias, shared expert
    assert dense.kv_bytes_per_token == 2 * (512 + 64)  # the latent, not per-head k/v


def test_untied_head_is_a_second_vocab_matrix():
    tied, untied = costs_of("qwen3-0.6b"), costs_of("qwen3-0.6b", tie_word_embeddings=False)
    assert untied.total_params - tied.total_params == 151936 * 1024
    # on one stage a tied head is the embedding itself: its fp32 shard and bf16 root copy once
    one = Hardware(gpus=1, gpu_memory_gb=80)
    work = Workload(colocated_rollout=False)
    params = [estimate(c, Layout(), one, work).breakdown.params for c in (tied, untied)]
    assert params[1] - params[0] == pytest.approx((4 + 2) * 151936 * 1024 / 2**30)


def _peak(name, layout, **work):
    hw = Hardware(gpus=layout.world, gpu_memory_gb=80)
    return estimate(costs_of(name), layout, hw, Workload(colocated_rollout=False, **work))


def test_offload_fraction_moves_moments_to_the_host():
    base = _peak("qwen3-8b", Layout(dp=8))
    half = _peak("qwen3-8b", Layout(dp=8, offload_fraction=0.5))
    per_gpu = 8_190_735_360 / 8 / 2**30
    assert half.breakdown.optimizer == pytest.approx(base.breakdown.optimizer / 2)
    assert base.gpu_memory_gb - half.gpu_memory_gb == pytest.approx(8 * 0.5 * per_gpu, rel=1e-6)
    # host: fp32 master + moments + pinned gradient staging of the offloaded half, per GPU of the node
    assert half.cpu_memory_gb_per_node - base.cpu_memory_gb_per_node == pytest.approx(8 * 16 * 0.5 * per_gpu)


def test_activations_follow_recompute_tp_cp_and_pipeline_in_flight():
    none = _peak("qwen3-8b", Layout(dp=1), recompute="none", max_tokens_per_gpu=8192).breakdown.activations
    sel = _peak(
        "qwen3-8b", Layout(dp=1), recompute="selective", max_tokens_per_gpu=8192
    ).breakdown.activations
    full = _peak("qwen3-8b", Layout(dp=1), recompute="full", max_tokens_per_gpu=8192).breakdown.activations
    assert none > sel > full
    double = _peak("qwen3-8b", Layout(dp=1), recompute="none", max_tokens_per_gpu=16384)
    assert double.breakdown.activations == pytest.approx(2 * none)
    tp2 = _peak("qwen3-8b", Layout(tp=2), recompute="none").breakdown.activations
    cp2 = _peak("qwen3-8b", Layout(cp=2), recompute="none").breakdown.activations
    assert tp2 == pytest.approx(none / 2) and cp2 == pytest.approx(none / 2)
    # 1F1B: stage s holds pp - s micro-batches, so the first stage's activations are the largest
    pp4 = _peak("qwen3-8b", Layout(pp=4), recompute="none")
    assert pp4.stage_peaks_gb[0] == max(pp4.stage_peaks_gb)
    assert pp4.breakdown.activations == pytest.approx(4 * none / 4, rel=0.1)  # 4 in flight x 1/4 of layers


def test_logprob_head_buffers_scale_with_the_chunk_and_vocab_over_tp():
    # without recompute the head's backward (every activation still saved) is the peak; from the
    # second chunk on, a chunk's bf16 logits and logit gradient and the previous chunk's gradient
    small, large = (
        _peak("qwen3-8b", Layout(dp=8), recompute="none", logprob_chunk_tokens=c) for c in (2048, 4096)
    )
    assert small.peak_phase == large.peak_phase == "head"
    assert large.breakdown.buffers - small.breakdown.buffers == pytest.approx(3 * 2048 * 151936 * 2 / 2**30)
    tp2 = _peak("qwen3-8b", Layout(tp=2, dp=4), recompute="none", logprob_chunk_tokens=4096)
    assert tp2.peak_phase == "head"
    chunks, hidden = 3 * 4096 * 151936 * 2 / 2**30, 2 * 2 * 8192 * 4096 / 2**30  # hidden: selected + grad
    assert tp2.breakdown.buffers - 0.5 - 2 * 2 * 8192 * 4096 / 2**30 == pytest.approx(chunks / 2 + hidden)


def test_rollout_weights_and_kv_cache():
    hw = Hardware(gpus=96, gpu_memory_gb=96)
    est = estimate(costs_of("deepseek-v3"), Layout(tp=8, pp=12, ep=8, offload_fraction=1.0), hw, Workload())
    assert est.rollout is not None and est.rollout.model_parallel == 32  # verl's rollout TP for 96 GB
    assert est.rollout.weights_gb == pytest.approx(2 * 671.0e9 / 32 / 2**30, rel=2e-3)
    colocated = replace(Workload(), rollout_weights_on_gpu=True, rollout_model_parallel=1)
    small = estimate(costs_of("qwen3-0.6b"), Layout(), Hardware(gpus=1, gpu_memory_gb=80), colocated)
    alone = estimate(costs_of("qwen3-0.6b"), Layout(), Hardware(gpus=1, gpu_memory_gb=80), Workload())
    assert small.gpu_memory_gb - alone.gpu_memory_gb == pytest.approx(2 * 596_049_920 / 2**30)


def test_fp8_rollout_holds_the_experts_in_one_byte_and_a_scale_per_128():
    """rollout.quantization=fp8 (rlloom/models/fp8.py): the routed experts at 1 + 4/128 bytes a
    parameter, everything else bf16; the run's start-up check passes the setting on."""
    from rlloom.config import load_config
    from rlloom.plan.check import run_layout

    costs, hw = costs_of("qwen3-30b-a3b"), Hardware(gpus=1, gpu_memory_gb=141)
    work = replace(Workload(), rollout_weights_on_gpu=True, rollout_model_parallel=1)
    bf16 = estimate(costs, Layout(offload_fraction=1.0), hw, work).rollout
    fp8 = estimate(costs, Layout(offload_fraction=1.0), hw, replace(work, rollout_quantization="fp8")).rollout
    experts = costs.expert_params
    assert experts > 0.9 * costs.total_params
    assert bf16.weights_gb - fp8.weights_gb == pytest.approx((1 - 4 / 128) * experts / 2**30)
    cfg = load_config("arithmetic_demo", ["rollout.quantization=fp8"])
    assert run_layout(cfg)[1].rollout_quantization == "fp8"


@pytest.mark.parametrize(
    ("name", "gpus", "degrees", "published", "least"),
    [
        ("deepseek-v3", 96, {"tp": 8, "pp": 12, "ep": 8}, 1.0, (0.75, 1.0)),
        ("deepseek-v3", 128, {"tp": 8, "pp": 16, "ep": 8}, 0.5, (0.5, 0.5)),
        ("deepseek-v3", 256, {"tp": 8, "pp": 16, "ep": 8}, 0.0, (0.0, 0.0)),
        ("qwen3-235b-a22b", 32, {"tp": 4, "pp": 8, "ep": 4}, 1.0, (0.75, 1.0)),
    ],
)
def test_least_offload_that_fits_agrees_with_verls_choice(name, gpus, degrees, published, least):
    """verl chose offload 1.0 / 0.5 / 0 for DeepSeek-V3 on 96 / 128 / 256 GPUs of 96 GB: the model
    finds offload needed (or not) at the same GPU counts."""
    from rlloom.plan.search import fit_layout

    dp = gpus // (degrees["tp"] * degrees["pp"])
    hw, work = Hardware(gpus=gpus, gpu_memory_gb=96), Workload(max_tokens_per_gpu=11680)
    est = fit_layout(costs_of(name), Layout(dp=dp, **degrees), hw, work)
    assert est.fits and least[0] <= est.layout.offload_fraction <= least[1]
    assert est.layout.offload_fraction <= published  # never more than the anchor needed
