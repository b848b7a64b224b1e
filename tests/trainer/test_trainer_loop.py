"""The RL loop end to end on a tiny model: logging, checkpoints, resume after a crash, options."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlloom.config import load_config
from rlloom.observability.startup import seconds_since_process_start
from rlloom.trainer.checkpoint import checkpoint_dir, checkpoint_model_tensors
from rlloom.trainer.run import run

NON_DETERMINISTIC = ("time/", "perf/", "sync/ms", "memory/")


def tiny_args(ckpt: Path, run_dir: Path, *extra: str) -> list[str]:
    """The overrides of a tiny run of the arithmetic_smoke recipe, as `rlloom train` takes them."""
    return [
        f"model.path={ckpt}",
        f"trainer.run_dir={run_dir}",
        "data.num_eval=4",
        "data.num_train=64",
        "rollout.max_new_tokens=5",
        "logging.console=false",
        "rollout.kv_cache_memory_gb=0.05",  # 200k tokens of the tiny model; zeroing 1 GiB cost 14% of a run
        *extra,
    ]


def tiny_cfg(ckpt: Path, run_dir: Path, *extra: str):
    return load_config("arithmetic_smoke", tiny_args(ckpt, run_dir, *extra))


def read_metrics(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if not k.startswith(NON_DETERMINISTIC)} for x in lines]


ALL_SAMPLES = "logging.samples_per_step=1000"
"""samples.jsonl then holds every trained sample (`prompts_per_step`)."""


def prompts_per_step(run_dir: Path) -> list[list[str]]:
    """The prompts of each step's trained samples, sorted, from a run with `ALL_SAMPLES`."""
    by_step: dict[int, list[str]] = {}
    for line in (run_dir / "samples.jsonl").read_text().splitlines():
        record = json.loads(line)
        by_step.setdefault(record["step"], []).append(record["prompt"])
    return [sorted(by_step[k]) for k in sorted(by_step)]


def run_straight_and_resumed(ckpt: Path, tmp_path: Path, *extra: str, steps: int = 3) -> tuple[Path, Path]:
    """Run folders of `steps` uninterrupted steps and of one step, then resumed to `steps`."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run(tiny_cfg(ckpt, straight, *extra, f"trainer.total_steps={steps}"))
    # save_every > 0: a run that ends at total_steps keeps its optimizer state only when asked to
    run(tiny_cfg(ckpt, resumed, *extra, "trainer.total_steps=1", "trainer.save_every=1"))
    run(tiny_cfg(ckpt, resumed, *extra, f"trainer.total_steps={steps}", "trainer.resume=auto"))
    return straight, resumed


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def final_weights(run_dir: Path, step: int, tmp: Path) -> dict[str, torch.Tensor]:
    """The model tensors of checkpoint step_N of a run (native names); `tmp` is unused."""
    return checkpoint_model_tensors(checkpoint_dir(run_dir, step))


def test_two_steps_log_every_metric_and_checkpoint(tiny_checkpoint, tmp_path, capsys):
    result = run(tiny_cfg(tiny_checkpoint, tmp_path / "run", "trainer.total_steps=2"))
    assert result.steps == 2
    assert "run: accuracy_before=" in capsys.readouterr().out  # the summary names the run (its folder)
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    step = records[1]
    for key in [
        "reward/mean", "reward/std", "train/accuracy", "response/length_mean", "response/length_max",
        "loss/clipfrac_low", "loss/clipfrac_high", "loss/approx_kl", "actor/entropy", "train/grad_norm",
        "train/lr", "time/generate_s", "time/train_s", "time/sync_s", "time/step_s", "sync/ms",
        "sync/ms_per_gb", "perf/step_tok_per_s", "memory/peak_gib", "policy/version",
        "rollout/logp_gap_abs", "rollout/logp_gap_max", "rollout/token_mult_prob_error",
    ]:  # fmt: skip
        assert key in step, key
    assert step["policy/version"] == 1 and records[2]["policy/version"] == 2
    # start-up: the first generated token, counted from this process's start, on the first step only
    assert 0 < step["perf/first_token_s"] < seconds_since_process_start()
    assert "perf/first_token_s" not in records[2]
    assert 0 <= step["rollout/logp_gap_abs"] < 1e-4 and 1 <= step["rollout/token_mult_prob_error"] < 1 + 1e-4
    assert step["rollout/logp_gap_abs"] <= step["rollout/logp_gap_max"] < 1e-4
    assert "eval/accuracy" in records[0] and "eval/accuracy" in records[2]
    assert (tmp_path / "run" / "checkpoints" / "step_000002" / "manifest.json").is_file()


def test_resume_auto_without_checkpoint_starts_fresh(tiny_checkpoint, tmp_path):
    result = run(tiny_cfg(tiny_checkpoint, tmp_path / "r", "trainer.total_steps=1", "trainer.resume=auto"))
    assert result.steps == 1


def test_resume_from_a_non_checkpoint_is_refused(tiny_checkpoint, tmp_path):
    from rlloom.config import ConfigError

    with pytest.raises(ConfigError, match="not a complete checkpoint"):
        run(tiny_cfg(tiny_checkpoint, tmp_path / "r", f"trainer.resume={tmp_path}"))


def test_heap_is_frozen_once_after_the_first_step(tiny_checkpoint, tmp_path, monkeypatch):
    # Python's full collections scanned the warm-up's objects (0.4 s pauses inside decode steps on
    # the MoE job): the run freezes the heap once, after its first step, in every process, and
    # thaws it when its groups close (so a finished run's engines can be collected).
    import gc

    from rlloom.cluster.build import Groups

    frozen = []
    real = Groups.freeze_heap

    def freeze(self):
        real(self)
        frozen.append(gc.get_freeze_count())

    monkeypatch.setattr(Groups, "freeze_heap", freeze)
    try:
        result = run(tiny_cfg(tiny_checkpoint, tmp_path / "run", "trainer.total_steps=3"))
        assert result.steps == 3 and len(frozen) == 1 and frozen[0] > 0
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()
