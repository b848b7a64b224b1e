"""rollout.match_training and trainer.deterministic on two GPUs (Ray, NCCL, bf16): `rlloom train` with
parallel.ep=2 into a one-GPU rollout (Qwen3-MoE, DeepSeek-V3 with MLA) and parallel.tp=2 into
rollout.tp=2 (dense) reads `rollout/logp_gap_max` 0.0 at every step, and two runs of one config give
the same metrics (timings aside) and the same final weights. The default kernels' gap is > 0 on the
same layout, so the check can fail. The CPU runs of the same layouts (gloo) are in
tests/trainer/test_match_training_parallel.py. Each run is its own process, as a user starts it.
Skipped without two GPUs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)
sys.path.insert(0, str(Path(__file__).parents[1] / "trainer"))

from test_trainer_loop import read_metrics, tiny_args  # noqa: E402

from rlloom.models.tiny import write_tiny_model  # noqa: E402
from rlloom.trainer.checkpoint import checkpoint_dir, checkpoint_model_tensors  # noqa: E402

STEPS = 2
RUN = [
    "cluster.device=cuda",
    "cluster.mode=ray",
    "cluster.num_workers=2",
    f"trainer.total_steps={STEPS}",
    "trainer.save_every=1",
    "trainer.save_hf_every=-1",
    "train.lr=3e-2",
    "data.num_eval=0",
    "rollout.max_new_tokens=12",
    "train.max_tokens_per_micro_batch=256",  # several micro-batches
]
LAYOUTS = [
    ("tiny-moe", ["parallel.ep=2"]),
    ("tiny-mla", ["parallel.ep=2"]),
    ("tiny-dense", ["parallel.tp=2", "rollout.tp=2"]),
]


def train(ckpt: Path, run_dir: Path, *extra: str) -> list[dict]:
    """`rlloom train arithmetic_smoke` in a fresh process -> its metrics (timings aside)."""
    args = tiny_args(ckpt, run_dir, *RUN, *extra)
    proc = subprocess.run(
        [sys.executable, "-m", "rlloom.cli", "train", "arithmetic_smoke", *args],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_metrics(run_dir)


def gaps(metrics: list[dict]) -> list[float]:
    found = [m["rollout/logp_gap_max"] for m in metrics if "rollout/logp_gap_max" in m]
    assert len(found) == STEPS
    return found


@pytest.mark.parametrize(("kind", "layout"), LAYOUTS)
def test_exact_and_deterministic_on_two_gpus(tmp_path, kind, layout):
    ckpt = write_tiny_model(kind, tmp_path / "ckpt", seed=0, hidden=128, layers=2)
    exact = ["rollout.match_training=true", "trainer.deterministic=true", *layout]
    first = train(ckpt, tmp_path / "a", *exact)
    assert gaps(first) == [0.0] * STEPS
    assert train(ckpt, tmp_path / "b", *exact) == first
    wa, wb = (checkpoint_model_tensors(checkpoint_dir(tmp_path / r, STEPS)) for r in ("a", "b"))
    assert wa.keys() == wb.keys() and len(wa) > 0
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name
    assert max(gaps(train(ckpt, tmp_path / "default", *layout))) > 0.0
