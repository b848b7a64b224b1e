"""A run you can watch, through the `rlloom` CLI on the tiny model: start-up phases with times, sample
completions on the console and in samples.jsonl, the warm-up step, eval metrics only on eval steps,
the summary line naming the run, W&B in offline mode, and `rlloom plot`'s panels."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rlloom.cli import main

TINY = (
    "data.num_eval=2",
    "data.num_train=16",
    "rollout.max_new_tokens=4",
    "trainer.total_steps=2",
    "trainer.save_hf_every=-1",
)


def train(ckpt: Path, run_dir: Path, *extra: str) -> int:
    return main(
        ["train", "arithmetic_smoke", f"model.path={ckpt}", f"trainer.run_dir={run_dir}", *TINY, *extra]
    )


def test_a_run_shows_its_phases_samples_warm_up_and_name(tiny_checkpoint, tmp_path, capsys):
    run_dir = tmp_path / "my_first_run"
    assert train(tiny_checkpoint, run_dir, "logging.samples_per_step=3") == 0
    captured = capsys.readouterr()
    out, err = captured.out, captured.err

    # Start-up phases, each with its time.
    for phase in ("tokenizer and data", "model and engines", "first evaluation"):
        assert re.search(rf"start-up: {phase} \d+\.\d s", err), phase
    steps = [line for line in out.splitlines() if line.startswith("[rlloom] step ")]
    assert [line.split(" | ")[0] for line in steps] == [f"[rlloom] step {i}/2" for i in range(3)]
    # The first training step is labelled warm-up and has no ETA; eval metrics only on eval steps
    # (before training and at the last step here, trainer.eval_every=0).
    assert "(warm-up) | eta after warm-up" in steps[1] and "eval_acc" not in steps[1]
    assert "eval_acc" in steps[0] and "eval_acc" in steps[2] and "warm-up" not in steps[2]

    # Three sample completions a step, on the console after the step's line and in samples.jsonl.
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1, 1, 1, 2, 2, 2]
    assert all(
        s["prompt"].startswith("What is ") and s["finish_reason"] in ("stop", "length") for s in samples
    )
    assert all(isinstance(s["reward"], float) and s["ground_truth"].isdigit() for s in samples)
    # Spread over the batch (2 prompts x 4 samples a step): both prompts of a step are shown.
    assert len({s["prompt"] for s in samples[:3]}) == 2
    shown = [line for line in out.splitlines() if line.startswith("[rlloom] sample 1.")]
    assert len(shown) == 3 and samples[0]["prompt"] in shown[0]
    assert out.index("[rlloom] step 1/2") < out.index("[rlloom] sample 1.1") < out.index("[rlloom] step 2/2")

    # The summary line names the run (its folder), not `demo:`.
    assert out.splitlines()[-1].startswith("my_first_run: accuracy_before=")


def test_wandb_offline_logs_metrics_samples_and_the_run_name(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    pytest.importorskip("wandb", reason="wandb is not installed (pip install 'rlloom[wandb]')")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "wb"
    args = ("logging.wandb=true", "logging.run_name=demo", "trainer.total_steps=1", "data.num_eval=0")
    assert train(tiny_checkpoint, run_dir, *args) == 0
    # logging.run_name names the run in the summary line (the demo's `make demo` sets it to demo).
    assert capsys.readouterr().out.splitlines()[-1].startswith("demo: accuracy_before=n/a")
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    offline = list((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(offline) == 1, list((run_dir / "wandb").iterdir())
    # The sample completions as a W&B table (2 a step by default).
    (table_file,) = (offline[0] / "files" / "media" / "table").glob("samples_1_*.table.json")
    table = json.loads(table_file.read_text())
    assert table["columns"] == ["step", "prompt", "response", "reward", "ground_truth", "finish_reason"]
    assert len(table["data"]) == 2 and table["data"][0][0] == 1
    # Metrics, the config and the run's name are in the offline log (protobuf records, strings as bytes).
    log = (offline[0] / f"run-{run_id}.wandb").read_bytes()
    for text in (b"reward/mean", b"train/grad_norm", b"samples_per_step", b"arithmetic", b"demo"):
        assert text in log, text


def test_plot_has_integer_step_ticks_the_training_panels_and_a_spread_band(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from rlloom.observability.plot import curves_figure

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    records = [
        {
            "step": step,
            "reward/mean": 0.1 * step,
            "reward/std": 0.05,
            "train/loss": 0.01,
            "loss/kl": 0.001 * step,
            "actor/entropy": 1.0,
            "train/grad_norm": 0.5,
            "loss/clipfrac_low": 0.0,
            "loss/clipfrac_high": 0.02,
            "response/clip_frac": 0.1,
        }
        for step in range(1, 4)
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["plot", str(run_dir)]) == 0
    assert (run_dir / "curves.png").read_bytes()[:4] == b"\x89PNG"

    axes = {ax.get_title(): ax for ax in curves_figure(run_dir).axes}
    for title in ("loss", "KL", "entropy", "gradient norm", "clip fractions"):
        assert any(t.startswith(title) for t in axes), (title, list(axes))
    for ax in axes.values():
        ticks = [t for t in ax.get_xticks() if 1 <= t <= 3]
        assert ticks and all(float(t).is_integer() for t in ticks), (ax.get_title(), ticks)
    reward = next(ax for title, ax in axes.items() if title.startswith("reward"))
    (band,) = reward.collections  # mean +- std across the step's samples
    low, high = band.get_paths()[0].vertices[:, 1].min(), band.get_paths()[0].vertices[:, 1].max()
    assert low == pytest.approx(0.1 - 0.05) and high == pytest.approx(0.3 + 0.05)


def test_step_line_shows_the_trained_batch_reward_kl_and_entropy(tiny_checkpoint, tmp_path, capsys):
    """Under dynamic sampling `reward` is the trained batch's (every kept sample, logged here in full
    to samples.jsonl), not the first sampling round's; a KL term shows `kl` and `entropy`."""
    run_dir = tmp_path / "dapo"
    reward = (
        "reward.name=resume_reward:digit_share",
        f"reward.import_dir={Path(__file__).parents[1] / 'trainer'}",
    )
    args = (
        "algorithm.dynamic_sampling=true",
        "algorithm.kl_coef=0.01",
        "logging.samples_per_step=8",
        "data.num_eval=0",
    )
    assert train(tiny_checkpoint, run_dir, *reward, *args) == 0
    steps = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[rlloom] step ")]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    # Step 1 dropped a group whose samples all scored alike: its first round's mean is another number.
    assert (
        metrics[0]["rollout/groups_dropped"] == 1
        and metrics[0]["reward/mean"] != metrics[0]["reward/trained_mean"]
    )
    for line, row in zip(steps, metrics, strict=True):
        kept = [s["reward"] for s in samples if s["step"] == row["step"]]
        assert row["reward/trained_mean"] == pytest.approx(sum(kept) / len(kept))
        assert f"| reward {row['reward/trained_mean']:.3f} |" in line
        assert f"| kl {row['loss/kl']:.4f} | entropy {row['actor/entropy']:.3f} |" in line
