"""trainer.deterministic on a GPU: two `rlloom train` runs of one config give the same metrics.jsonl
(timing keys aside) and the same final weights, bit for bit, for the three tiny families (dense
Qwen3, Qwen3-MoE, DeepSeek-V3 with MLA), and a run killed with SIGKILL and resumed with
trainer.resume=auto equals the uninterrupted one. Each run is its own process, as a user starts it
(cuBLAS reads its workspace setting when the process first uses it). Skipped without a GPU.

The settings make a difference visible: lr 3e-2 moves the sampled completions after one step, so a
backward pass that is not deterministic (the case before this mode: 25 of 512 responses differed at
step 2 on an H200) changes the second step's samples, rewards and losses."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
sys.path.insert(0, str(Path(__file__).parents[1] / "trainer"))

from test_trainer_loop import read_metrics  # noqa: E402

from rlloom.models.tiny import write_tiny_model  # noqa: E402
from rlloom.trainer.checkpoint import checkpoint_dir, checkpoint_model_tensors  # noqa: E402

STEPS = 3
SETTINGS = [
    "cluster.device=cuda",
    "trainer.deterministic=true",
    f"trainer.total_steps={STEPS}",
    "trainer.save_every=1",
    "trainer.prompts_per_step=16",
    "train.lr=3e-2",
    "data.num_train=64",
    "data.num_eval=0",
    "rollout.max_new_tokens=16",
    "logging.console=false",
]


def train(ckpt: Path, run_dir: Path, *extra: str, env: dict[str, str] | None = None) -> int:
    """`rlloom train arithmetic_smoke` in a fresh process; its wait status."""
    args = [f"model.path={ckpt}", f"trainer.run_dir={run_dir}", *SETTINGS, *extra]
    proc = subprocess.run(
        [sys.executable, "-m", "rlloom.cli", "train", "arithmetic_smoke", *args],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
    )
    assert proc.returncode in (0, -signal.SIGKILL), proc.stderr[-3000:]
    return proc.returncode


def assert_same_run(a: Path, b: Path) -> None:
    ma, mb = read_metrics(a), read_metrics(b)
    assert [m["step"] for m in ma] == list(range(1, STEPS + 1))
    assert ma == mb
    wa, wb = (checkpoint_model_tensors(checkpoint_dir(r, STEPS)) for r in (a, b))
    assert wa.keys() == wb.keys() and len(wa) > 0
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


@pytest.mark.parametrize("kind", ["tiny-dense", "tiny-moe", "tiny-mla"])
def test_two_deterministic_runs_are_equal(tmp_path, kind):
    ckpt = write_tiny_model(kind, tmp_path / "ckpt", seed=0, hidden=128, layers=2)
    train(ckpt, tmp_path / "a")
    train(ckpt, tmp_path / "b")
    assert_same_run(tmp_path / "a", tmp_path / "b")


def test_kill_then_resume_equals_the_straight_run(tmp_path):
    ckpt = write_tiny_model("tiny-moe", tmp_path / "ckpt", seed=0, hidden=128, layers=2)
    train(ckpt, tmp_path / "straight")
    killed = tmp_path / "killed"
    # SIGKILL after step 2's policy update, before its weights reach the rollout: resumed from step 1
    assert train(ckpt, killed, env={"RLLOOM_FAULT": "train:1"}) == -signal.SIGKILL
    assert train(ckpt, killed, "trainer.resume=auto") == 0
    assert_same_run(tmp_path / "straight", killed)


def test_top_p_sampling_runs_in_deterministic_mode(restore_determinism):
    """torch's CUDA cumsum of floats raises under deterministic algorithms; top-p's scan takes the CPU."""
    from rlloom.determinism import enable_determinism
    from rlloom.engines.rollout.native.sampler import Sampler, SamplingRows

    enable_determinism(True)
    logits_RV = torch.randn(4, 1000, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    rows = SamplingRows.build([1.0] * 4, [0.9] * 4, [-1] * 4, [1, 2, 3, 4], torch.device("cuda"))
    first = Sampler(torch.device("cuda"), seed=0)(logits_RV, rows)
    again = Sampler(torch.device("cuda"), seed=0)(logits_RV, rows)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
