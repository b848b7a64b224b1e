"""rollout.match_training and trainer.deterministic in the parallel layouts they cover, through
`rlloom train` with 2 Ray workers on gloo (the CPU's exact numerics; tests/gpu/test_exact_parallel_gpu.py
runs the same on 2 GPUs with NCCL):
- parallel.ep=2 into a one-process rollout (rollout.tp=1), Qwen3-MoE and DeepSeek-V3 (MLA): the
  all-to-alls only move rows, each expert's product is per row and a token's K outputs are summed
  in one order on its own rank, so the forward is the one process's.
- parallel.tp=2 into rollout.tp=2 (dense): both engines add a row-parallel product's two partials
  and take the log-softmax of the gathered logits (models/exact.py, parallel/vocab_parallel.py).
`rollout/logp_gap_max` is 0.0 at every step; without match_training it is not (the check can
fail). The exact runs are deterministic ones too: run twice (MoE, dense), they give the same metrics (but
timings) and the same final weights."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from test_trainer_loop import read_metrics, tiny_args

from rlloom.cli import main
from rlloom.models.tiny import write_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

STEPS = ["trainer.total_steps=2", "train.lr=3e-2", "data.num_eval=0", "trainer.save_hf_every=-1"]
RAY = ["cluster.mode=ray", "cluster.num_workers=2"]


def train(ckpt: Path, run_dir: Path, *extra: str) -> tuple[list[float], list[dict], str]:
    """(`rollout/logp_gap_max` of each step, the metrics but timings, a digest of the final weights)."""
    assert main(["train", "arithmetic_smoke", *tiny_args(ckpt, run_dir, *STEPS, *RAY, *extra)]) == 0
    metrics = read_metrics(run_dir)
    gaps = [m["rollout/logp_gap_max"] for m in metrics if "rollout/logp_gap_max" in m]
    assert len(gaps) == 2
    weights = sorted((run_dir / "checkpoints").glob("step_*/hf/*.safetensors"))
    assert weights
    return gaps, metrics, hashlib.sha256(b"".join(w.read_bytes() for w in weights)).hexdigest()


@pytest.mark.parametrize(
    ("kind", "layout"),
    [
        ("tiny-moe", ["parallel.ep=2"]),
        ("tiny-mla", ["parallel.ep=2"]),
        ("tiny-dense", ["parallel.tp=2", "rollout.tp=2"]),
    ],
)
def test_exact_and_deterministic_in_a_parallel_layout(tmp_path, kind, layout):
    ckpt = write_tiny_model(kind, tmp_path / "ckpt", seed=0, hidden=32, layers=2)
    exact = ["rollout.match_training=true", "trainer.deterministic=true", *layout]
    gaps, metrics, weights = train(ckpt, tmp_path / "a", *exact)
    assert gaps == [0.0, 0.0]
    if kind == "tiny-mla":  # its experts' exchange is tiny-moe's: the repeat and the control are there
        return
    again = train(ckpt, tmp_path / "b", *exact)
    assert again == (gaps, metrics, weights)  # the deterministic run repeats, weights included
    assert max(train(ckpt, tmp_path / "default", *layout)[0]) > 0.0  # the default rounds otherwise
