"""The trainer's start-up memory checks on the run's layout: `check_fits(cfg)` warns (the memory
model's margins), `check_memory(cfg)` refuses a peak beyond the device's memory in one line."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from rlloom.cli import main
from rlloom.config import load_config
from rlloom.plan import check
from rlloom.plan.published import CONFIG_DIR
from rlloom.trainer.run import run

CONFIGS = CONFIG_DIR  # the published configs rlloom ships


def cfg_for(model: Path, *overrides: str):
    return load_config("arithmetic_smoke", [f"model.path={model}", *overrides])


def test_qwen3_8b_fits_an_h200_only_with_optimizer_offload(tmp_path):
    model = tmp_path / "qwen3-8b"
    shutil.copytree(CONFIGS / "qwen3-8b", model)  # config.json only: no weights are read
    tokens = ["train.max_tokens_per_micro_batch=8192", "train.activation_checkpointing=full"]
    warning = check.fit_warning(cfg_for(model, *tokens), gpu_memory_gb=141)
    # 8.2B x 16 bytes of fp32 weights, grads and moments plus the rollout's bf16 copy
    assert warning is not None and "will not fit" in warning and "tp=1 pp=1" in warning
    assert "\n" not in warning and "train.optimizer_offload=true" in warning
    offloaded = cfg_for(model, *tokens, "train.optimizer_offload=true")
    assert check.fit_warning(offloaded, gpu_memory_gb=141) is None
    assert check.fit_warning(offloaded, gpu_memory_gb=80) is not None
    # no activation checkpointing at 64k tokens a micro-batch: the activations alone break it
    long = cfg_for(model, "train.optimizer_offload=true", "train.max_tokens_per_micro_batch=65536")
    assert check.fit_warning(long, gpu_memory_gb=141) is not None
    # a KV cache that stays allocated during training counts against the training peak
    kv = ["train.optimizer_offload=true", "rollout.kv_cache_memory_gb=60"]
    tight = cfg_for(model, *tokens, *kv, "rollout.sleep_during_train=true")
    assert check.fit_warning(tight, gpu_memory_gb=141) is None
    awake = cfg_for(model, *tokens, *kv, "rollout.sleep_during_train=false")
    assert check.fit_warning(awake, gpu_memory_gb=141) is not None


def test_train_warns_before_launching_a_run_that_will_not_fit(tiny_checkpoint, tmp_path, monkeypatch):
    cfg = load_config(
        "arithmetic_smoke",
        [f"model.path={tiny_checkpoint}", f"trainer.run_dir={tmp_path}", "trainer.total_steps=0",
         "data.num_eval=0", "data.num_train=8", "logging.console=false"],
    )  # fmt: skip
    # A GPU with 1 MB left after the CUDA context; the tiny model fits 80 GB (the test above:
    # fit_warning returns None for runs that fit).
    monkeypatch.setattr(check, "device_memory_gb", lambda cfg: (2.001, 0.0))
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logging.getLogger("rlloom").addHandler(handler)
    try:
        run(cfg)
    finally:
        logging.getLogger("rlloom").removeHandler(handler)
    assert any("the memory model predicts this run will not fit" in r.getMessage() for r in records)
    assert check.fit_warning(cfg, gpu_memory_gb=80) is None


def test_a_critic_keeps_its_weights_and_moments_beside_the_policy(tmp_path):
    import json

    from rlloom.models.args import ModelArgs
    from rlloom.plan.counts import model_costs
    from rlloom.plan.inputs import Hardware, Layout, Workload
    from rlloom.plan.memory import GB, estimate

    model = tmp_path / "qwen3-8b"
    shutil.copytree(CONFIGS / "qwen3-8b", model)
    tokens = ["train.max_tokens_per_micro_batch=8192", "train.activation_checkpointing=full"]
    # PPO with a critic: a second 8B model's fp32 weights stay on the GPU (its moments on the host):
    # 91 GB without, 119 GB with, on a GPU with 112 GB usable
    offload = [*tokens, "train.optimizer_offload=true"]
    assert check.fit_warning(cfg_for(model, *offload), gpu_memory_gb=120) is None
    assert check.fit_warning(cfg_for(model, *offload, "algorithm.estimator=gae"), gpu_memory_gb=120)

    costs = model_costs(ModelArgs.from_hf_config(json.loads((model / "config.json").read_text())))
    critic = costs.total_params - costs.vocab_size * costs.hidden_size  # untied: no vocabulary head
    hw = Hardware(gpus=2, gpu_memory_gb=141)
    for layout, per_param in [
        (Layout(), 4 + 8),  # one GPU without FSDP: fp32 masters and moments (bf16 copies only in its step)
        (Layout(dp=2), (4 + 8) / 2),  # FSDP shards both
        (Layout(dp=2, offload_fraction=0.5), (4 + 4) / 2),  # half the moments on the host
    ]:
        without = estimate(costs, layout, hw, Workload()).gpu_memory_gb
        with_critic = estimate(costs, layout, hw, Workload(critic_params=critic)).gpu_memory_gb
        assert with_critic - without == pytest.approx(per_param * critic / GB), layout


def test_the_critic_state_matches_its_measurement_on_one_gpu():
    # bench_e2e's Qwen3-0.6B shape on one H100 (docs/benchmarks.md, 2026-11-25): PPO with a critic
    # peaked at 61.95 GiB allocated, GRPO in the same call at 55.28 GiB; the difference is what the
    # critic keeps while the policy trains (fp32 weights and AdamW moments: 12 bytes a parameter)
    from rlloom.models.args import ModelArgs
    from rlloom.plan.counts import model_costs, value_model_params
    from rlloom.plan.inputs import Layout
    from rlloom.plan.memory import critic_state_gb

    shape = dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                 tie_word_embeddings=True, max_position_embeddings=4096)  # fmt: skip
    critic = value_model_params(model_costs(ModelArgs.from_hf_config(shape)))
    assert sum(critic_state_gb(critic, Layout())) == pytest.approx(61.95 - 55.28, rel=0.01)


HUGE_MICRO_BATCH = ["rollout.n_samples=20000", "train.max_tokens_per_micro_batch=100000000"]
"""A step of 2 x 20000 sequences of 264 tokens, all in one micro-batch: about 70 GiB of activations on
the tiny model on CPU (fp32, eager); its samples need only 1.3 GiB of host memory."""


def train_line(ckpt: Path, tmp_path: Path, *extra: str) -> list[str]:
    return ["train", "arithmetic_smoke", f"model.path={ckpt}", f"trainer.run_dir={tmp_path / 'run'}",
            "logging.console=false", "data.num_eval=2", "data.num_train=16", *extra]  # fmt: skip


@pytest.mark.parametrize(
    "layout, shared",
    [
        ([], ""),
        (["cluster.mode=ray", "cluster.num_workers=2", "parallel.tp=2"], "shared by 2 ranks"),
        (["cluster.mode=ray", "cluster.num_workers=2", "parallel.pp=2"], "shared by 2 ranks"),
    ],
    ids=["one_rank", "tp2", "pp2"],
)
def test_a_micro_batch_the_host_cannot_hold_is_one_line_at_start_up(
    layout, shared, tiny_checkpoint, tmp_path, capsys, monkeypatch
):
    # a host with 4 GiB available (the check reads MemAvailable; fixed here so that the case
    # does not depend on the machine); Ray is not started: the check runs before anything is built
    monkeypatch.setattr(check, "available_memory_bytes", lambda device: 4 * 2**30)
    rc = main(train_line(tiny_checkpoint, tmp_path, *HUGE_MICRO_BATCH, *layout))
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    line = lines[0]
    assert line.startswith("rlloom: error: train.max_tokens_per_micro_batch=100000000 is too large here"), (
        line
    )
    assert "this host has 4.0 GiB available" in line and shared in line, line
    assert "Fix: lower train.max_tokens_per_micro_batch to " in line, line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    # the budget the line proposes passes the check; one far above it does not
    fitting = int(line.split("Fix: lower train.max_tokens_per_micro_batch to ")[1].split()[0])
    base = [f"model.path={tiny_checkpoint}", *HUGE_MICRO_BATCH, *layout]
    memory = check.rank_memory(load_config("arithmetic_smoke", base))
    for budget, fits in [(fitting, True), (2 * fitting, False)]:
        cfg = load_config("arithmetic_smoke", [*base, f"train.max_tokens_per_micro_batch={budget}"])
        assert (check.memory_problem(cfg, memory) is None) == fits, budget


def test_model_states_a_gpu_cannot_hold_name_the_workers(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    # a GPU of 0.5 GiB: the smoke recipe's rollout keeps its 1 GiB KV cache while training
    # (rollout.sleep_during_train=false), so no micro-batch fits: the line names the layout instead
    monkeypatch.setattr(check, "device_memory_gb", lambda cfg: (0.5, 0.0))
    rc = main(train_line(tiny_checkpoint, tmp_path))
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("rlloom: error: cluster.num_workers=1 is too few here"), lines[0]
    assert "a GPU has 0.5 GiB" in lines[0] and "one 264-token sequence" in lines[0], lines[0]
    assert "train.optimizer_offload=true" in lines[0] and "rlloom plan" in lines[0], lines[0]


def test_two_stages_with_one_size_given_split_as_training_does():
    """`parallel.pp_first_stage_layers=1` alone on 4 layers and pp=2 is a valid layout (the last
    stage holds the other 3); the start-up memory check estimated it with an "impossible" split."""
    from rlloom.parallel.pp_stages import split_layers
    from rlloom.plan.stages import stage_ranges

    assert stage_ranges(4, 2, first=1) == split_layers(4, 2, first_stage_layers=1) == [range(1), range(1, 4)]
    assert stage_ranges(4, 2, last=3) == [range(1), range(1, 4)]
    assert stage_ranges(5, 2) == [range(3), range(3, 5)]
