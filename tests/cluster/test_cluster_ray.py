"""Ray worker group on CPU (gloo): same results as inline, and a dead actor stops the run cleanly."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("ray", reason="needs the ray extra: pip install 'rlloom[ray]'")

from rlloom.cluster import WorkerFailure  # noqa: E402
from rlloom.config import load_config  # noqa: E402
from rlloom.trainer.checkpoint import checkpoint_dir, checkpoint_model_tensors  # noqa: E402
from rlloom.trainer.run import run  # noqa: E402

SKIP = ("time/", "perf/", "sync/ms", "memory/")


def cfg_for(ckpt: Path, run_dir: Path, *extra: str):
    return load_config(
        "arithmetic_smoke",
        [
            f"model.path={ckpt}",
            f"trainer.run_dir={run_dir}",
            "trainer.total_steps=3",
            "trainer.prompts_per_step=4",
            "data.num_eval=4",
            "data.num_train=64",
            "rollout.max_new_tokens=5",
            "logging.console=false",
            *extra,
        ],
    )


def metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(SKIP)} for r in rows]


def weights(run_dir: Path, step: int, tmp: Path) -> dict[str, torch.Tensor]:
    return checkpoint_model_tensors(checkpoint_dir(run_dir, step))


def test_two_ray_workers_match_inline(tiny_checkpoint, tmp_path):
    run(cfg_for(tiny_checkpoint, tmp_path / "inline"))
    run(cfg_for(tiny_checkpoint, tmp_path / "ray", "cluster.mode=ray", "cluster.num_workers=2"))
    a, b = metrics(tmp_path / "inline"), metrics(tmp_path / "ray")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [0, 1, 2, 3]
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys()
        for k in ra:
            assert ra[k] == pytest.approx(rb[k], rel=1e-6, abs=1e-6), (ra["step"], k)
    wa, wb = weights(tmp_path / "inline", 3, tmp_path), weights(tmp_path / "ray", 3, tmp_path)
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=1e-6, msg=k)


def test_dead_actor_is_reported_and_resume_finishes(tiny_checkpoint, tmp_path, monkeypatch):
    run_dir = tmp_path / "crash"
    ray_args = ("cluster.mode=ray", "cluster.num_workers=2", "cluster.timeout_s=60", "trainer.save_every=1")
    monkeypatch.setenv("RLLOOM_FAULT", "update_policy:2:1")  # rank 1 dies during step 3's update
    start = time.monotonic()
    with pytest.raises(WorkerFailure, match=r"rank 1 on .* failed in stage 'update_policy'"):
        run(cfg_for(tiny_checkpoint, run_dir, *ray_args))
    assert time.monotonic() - start < 120
    monkeypatch.delenv("RLLOOM_FAULT")
    result = run(cfg_for(tiny_checkpoint, run_dir, *ray_args, "trainer.resume=auto"))
    assert result.steps == 3
    assert [r["step"] for r in metrics(run_dir)] == [0, 1, 2, 3]
