"""LoRA in the memory model, `rlloom plan --lora-rank` and the run's start-up check: the adapters
counted as `apply_lora` makes them, only they hold gradients and AdamW moments, the frozen base in
bf16 (on one device without a compute copy, under FSDP in bf16 shards), and the saving measured on one H100. The start-up
check models the run's own layout (parallel.*, placement, LoRA)."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from test_plan_check import cfg_for

from rlloom.cli import main
from rlloom.models.args import ModelArgs
from rlloom.models.lora import apply_lora
from rlloom.models.model import CausalLM
from rlloom.plan import check
from rlloom.plan.counts import lora_params, model_costs
from rlloom.plan.inputs import Hardware, Layout, Workload
from rlloom.plan.memory import GB, estimate
from rlloom.plan.published import CONFIG_DIR

CONFIGS = CONFIG_DIR  # the published configs rlloom ships


def raw_config(name: str, **overrides) -> dict:
    return json.loads((CONFIGS / name / "config.json").read_text()) | overrides


@pytest.mark.parametrize(
    ("name", "overrides"),
    [
        ("qwen3-0.6b", {}),
        ("qwen3-30b-a3b", {}),  # routed experts only: attention adapters
        ("deepseek-v3", {}),  # MLA with q-LoRA, 3 dense layers then MoE with a shared expert
        ("deepseek-v3", {"q_lora_rank": None}),  # MLA's plain query projection
    ],
)
@pytest.mark.parametrize("targets", ["all-linear", "q_proj,v_proj", "kv_b_proj,down_proj", "o_proj"])
def test_adapter_count_is_what_apply_lora_adds(name, overrides, targets):
    raw = raw_config(name, num_hidden_layers=5, **overrides)  # 5 layers: DeepSeek's dense and MoE kinds
    args = ModelArgs.from_hf_config(raw)
    with torch.device("meta"):
        model = CausalLM(args, raw)
    want = lora_params(args, 8, targets)
    if want == 0:  # nothing to adapt: the engine refuses it (a ConfigError), and so does `rlloom plan`
        with pytest.raises(Exception, match="matches no projection"):
            apply_lora(model, rank=8, alpha=16, targets=targets)
        return
    apply_lora(model, rank=8, alpha=16, targets=targets)
    assert want == sum(p.numel() for p in model.parameters() if p.requires_grad)


QWEN3_06B = dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                 tie_word_embeddings=True, max_position_embeddings=4096)  # fmt: skip


def test_only_the_adapters_hold_gradients_and_moments():
    args = ModelArgs.from_hf_config(QWEN3_06B)
    costs, adapters = model_costs(args), lora_params(args, 16, "all-linear")
    P, A = costs.total_params, adapters
    hw = Hardware(gpus=2, gpu_memory_gb=80)
    work = Workload(max_tokens_per_gpu=8192, micro_batches=2, colocated_rollout=False, lora_params=A)
    one = estimate(costs, Layout(), hw, work)
    # one device: the frozen base in bf16, the adapters' fp32 masters, bf16 copies and moments
    assert one.peak_phase == "head"
    assert one.breakdown.params == pytest.approx((2 * P + 4 * A + 2 * A) / GB)
    assert one.breakdown.optimizer == pytest.approx(8 * A / GB)
    assert one.breakdown.grads == pytest.approx(4 * A / GB)  # the first micro-batch's; the head is frozen
    # FSDP over 2 GPUs: bf16 shards of the base, fp32 shards of the adapters, half their moments
    two = estimate(costs, Layout(dp=2), hw, work)
    full = estimate(costs, Layout(dp=2), hw, Workload(max_tokens_per_gpu=8192, colocated_rollout=False))
    assert two.breakdown.optimizer == pytest.approx(8 * A / 2 / GB)
    assert two.breakdown.params == pytest.approx(full.breakdown.params - (2 * P - 4 * A) / 2 / GB)
    assert two.breakdown.grads < 0.02 * full.breakdown.grads  # 20 MB against 1.7 GB


@pytest.mark.parametrize(
    ("offload", "full_gib", "lora_gib"),
    [
        # one device without FSDP: the frozen base in bf16 without a compute copy (same call)
        (0.0, 55.28, 46.1),
        # optimizer offload: one GPU trains under FSDP2, the base in bf16 shards (another call)
        (1.0, 50.8, 47.1),
    ],
)
def test_the_saving_matches_its_measurement_on_one_gpu(offload, full_gib, lora_gib):
    # bench_e2e's Qwen3-0.6B shape on one H100 (docs/benchmarks.md, 2026-11-25): full fine-tuning
    # against LoRA r16 on every projection, peak allocated GiB in the same call (32768-token
    # micro-batches, several a step; the activations are the same)
    args = ModelArgs.from_hf_config(QWEN3_06B)
    costs = model_costs(args)
    work = Workload(max_tokens_per_gpu=32768, micro_batches=2, colocated_rollout=False)
    lora = dataclasses.replace(work, lora_params=lora_params(args, 16, "all-linear"))
    hw, layout = Hardware(gpus=1, gpu_memory_gb=80), Layout(offload_fraction=offload)
    saving = estimate(costs, layout, hw, work).gpu_memory_gb - estimate(costs, layout, hw, lora).gpu_memory_gb
    assert saving == pytest.approx(full_gib - lora_gib, rel=0.04)


def test_the_start_up_check_models_the_runs_layout_and_lora(tmp_path):
    model = tmp_path / "qwen3-8b"
    shutil.copytree(CONFIGS / "qwen3-8b", model)  # config.json only: no weights are read
    tokens = ["train.max_tokens_per_micro_batch=8192", "train.activation_checkpointing=full"]
    # 8.2B fully fine-tuned does not fit one 80 GB GPU; with LoRA r16 it does (bf16 base, the
    # rollout's bf16 copy, small adapters)
    assert check.fit_warning(cfg_for(model, *tokens), gpu_memory_gb=80) is not None
    lora = ["train.lora_rank=16", "train.lora_alpha=32"]
    assert check.fit_warning(cfg_for(model, *tokens, *lora), gpu_memory_gb=80) is None
    # the run's parallel degrees, not dp = num_workers
    ray = ["cluster.mode=ray", "cluster.num_workers=4"]
    layout, _ = check.run_layout(
        cfg_for(model, *ray, "parallel.tp=2", "parallel.pp=2", "parallel.pp_first_stage_layers=20")
    )
    assert (layout.tp, layout.pp, layout.dp, layout.pp_first_stage_layers) == (2, 2, 1, 20)
    # 128k tokens a micro-batch: the activations fit when tensor parallelism splits them, not as
    # data parallelism
    long = [*ray, *tokens[1:], "train.optimizer_offload=true", "train.max_tokens_per_micro_batch=131072"]
    assert check.fit_warning(cfg_for(model, *long), gpu_memory_gb=80) is not None
    assert check.fit_warning(cfg_for(model, *long, "parallel.tp=4"), gpu_memory_gb=80) is None
    # a rollout pool of its own: the training GPUs keep no rollout weights or KV cache
    _, work = check.run_layout(
        cfg_for(model, *ray, "cluster.placement=separate", "cluster.rollout_workers=2")
    )
    assert not work.colocated_rollout
    _, work = check.run_layout(cfg_for(model, *ray, "rollout.tp=2"))
    assert work.colocated_rollout and work.rollout_model_parallel == 2


def plan(capsys, *args: str) -> tuple[int, dict]:
    code = main(["plan", str(CONFIGS / "qwen3-8b"), "--gpus", "1", "--gpu-memory-gb", "80", *args, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_rlloom_plan_with_lora(capsys):
    code, full = plan(capsys)
    assert code == 1 and not full["fits"]
    code, lora = plan(capsys, "--lora-rank", "16")
    assert (
        code == 0
        and lora["fits"]
        and lora["lora_params"]
        == lora_params(ModelArgs.from_hf_config(raw_config("qwen3-8b")), 16, "all-linear")
    )
    assert lora["breakdown"]["optimizer"] == round(8 * lora["lora_params"] / GB, 2)  # the adapters' moments
    # every layout is open to LoRA: the search still prefers plain FSDP here (all fit)
    code, wide = plan(capsys, "--lora-rank", "16", "--gpus", "8")
    assert code == 0 and wide["fits"] and wide["alternatives"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--lora-rank", "-1"], "--lora-rank=-1 is invalid"),
        (["--lora-rank", "8", "--lora-target-modules", "kv_b_proj"], "matches no projection"),
        (["--lora-rank", "8", "--lora-target-modules", "qkv"], "must be all-linear or a comma list"),
    ],
)
def test_bad_lora_input_is_one_error_line_and_exit_2(capsys, args, message):
    assert main(["plan", str(CONFIGS / "qwen3-8b"), "--gpus", "2", "--gpu-memory-gb", "80", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlloom: error: ") and err.count("\n") == 1 and message in err
