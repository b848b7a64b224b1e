"""Ray groups on CPU (gloo): every placement reproduces the one-process run of PPO with a critic
(the critic's ranks on the training actors, FSDP over them); under separate placement a rollout
actor killed mid-generation stops the run cleanly and `trainer.resume=auto` finishes it as the
one-process run.

The session's one Ray instance (conftest's `ray_cluster`) serves the runs; they join it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray", reason="needs the ray extra: pip install 'rlloom[ray]'")

from rlloom.cluster import WorkerFailure  # noqa: E402
from rlloom.config import load_config  # noqa: E402
from rlloom.trainer.checkpoint import checkpoint_dir, checkpoint_model_tensors  # noqa: E402
from rlloom.trainer.run import run  # noqa: E402

pytestmark = pytest.mark.usefixtures("ray_cluster")
SKIP = ("time/", "perf/", "sync/ms", "memory/")
STEPS = 2
CHANGING = [  # a learning rate that changes the samples, a reward that varies, two optimizer steps a step
    "train.lr=3e-2",
    "algorithm.estimator=gae",  # PPO with a critic: the critic's actors, checkpoint and resume too
    "critic.lr=1e-2",
    "reward.name=resume_reward:digit_share",
    f"reward.import_dir={Path(__file__).parents[1] / 'trainer'}",
    "reward.num_workers=1",
    "trainer.num_mini_batches=2",
    "algorithm.kl_coef=0.1",
]


def cfg_for(ckpt: Path, run_dir: Path, *extra: str):
    return load_config(
        "arithmetic_smoke",
        [
            f"model.path={ckpt}",
            f"trainer.run_dir={run_dir}",
            f"trainer.total_steps={STEPS}",
            "trainer.prompts_per_step=4",
            "data.num_eval=4",
            "data.num_train=64",
            "rollout.max_new_tokens=5",
            "logging.console=false",
            *CHANGING,
            *extra,
        ],
    )


def metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(SKIP)} for r in rows]


def assert_same_run(a: Path, b: Path) -> None:
    ma, mb = metrics(a), metrics(b)
    assert [r["step"] for r in ma] == [r["step"] for r in mb] == list(range(STEPS + 1))
    for ra, rb in zip(ma, mb):
        assert ra.keys() == rb.keys(), (b.name, ra.keys() ^ rb.keys())
        for k in ra:
            # a token whose value sits on the clip's edge may switch sides with rounding (1 of 80)
            near = 0.025 if k == "critic/vf_clipfrac" else 1e-6
            assert ra[k] == pytest.approx(rb[k], rel=1e-5, abs=near), (b.name, ra["step"], k)
    wa = checkpoint_model_tensors(checkpoint_dir(a, STEPS))
    wb = checkpoint_model_tensors(checkpoint_dir(b, STEPS))
    assert wa.keys() == wb.keys()
    for k in wa:
        # Two data-parallel ranks add the gradient in another order; Adam at lr 3e-2 turns that
        # rounding into differences of ~1e-5 in a few elements (the metrics still agree to 1e-5).
        torch.testing.assert_close(
            wa[k], wb[k], rtol=1e-5, atol=5e-5, msg=lambda m, k=k: f"{b.name} {k}: {m}"
        )


@pytest.fixture(scope="module")
def inline(tiny_checkpoint, tmp_path_factory) -> Path:
    """The one-process run every placement is compared with."""
    run_dir = tmp_path_factory.mktemp("inline")
    run(cfg_for(tiny_checkpoint, run_dir))
    rewards = [r["reward/mean"] for r in metrics(run_dir)[1:]]
    assert len(set(rewards)) > 1, "the samples should change from step to step"
    return run_dir


def test_colocated_placement_matches_one_process(tiny_checkpoint, inline, tmp_path):
    # Engines of 4 sequences: the 4 prompts go out in 4 chunks to whichever replica is free; the
    # rollout sleeps during training and wakes for the sync. (Separate placement: the next test.)
    extra = ["cluster.num_workers=2", "rollout.max_num_seqs=4", "rollout.sleep_during_train=true"]
    run(cfg_for(tiny_checkpoint, tmp_path, "cluster.mode=ray", *extra))
    assert_same_run(inline, tmp_path)


def test_killed_rollout_actor_is_reported_and_resume_matches_one_process(
    tiny_checkpoint, inline, tmp_path, monkeypatch
):
    """Separate placement (2 training + 1 rollout workers; 1 + 1 runs in test_async_ray.py): a
    rollout actor killed in step 2 fails the run cleanly, and `trainer.resume=auto` finishes it with
    the one-process run's metrics and weights."""
    run_dir = tmp_path / "crash"
    args = (
        "cluster.mode=ray",
        "cluster.placement=separate",
        "cluster.num_workers=2",
        "cluster.rollout_workers=1",
        "cluster.timeout_s=60",
        "trainer.save_every=1",
    )
    # Rollout rank 0 dies generating step 2's samples (policy version 2: two mini-batches a step).
    monkeypatch.setenv("RLLOOM_FAULT", "rollout:2:0")
    start = time.monotonic()
    with pytest.raises(WorkerFailure, match=r"rollout rank 0 on \S+ \(pid \d+\) failed in stage 'generate'"):
        run(cfg_for(tiny_checkpoint, run_dir, *args))
    assert time.monotonic() - start < 60
    assert [r["step"] for r in metrics(run_dir)] == [0, 1]  # step 1 done and saved, step 2 lost
    monkeypatch.delenv("RLLOOM_FAULT")
    result = run(cfg_for(tiny_checkpoint, run_dir, *args, "trainer.resume=auto"))
    assert result.steps == STEPS
    assert_same_run(inline, run_dir)  # the steps [0, 1, 2], each as in the one-process run


def test_fp8_rollout_on_its_own_worker_matches_one_process(tiny_moe_checkpoint, tmp_path):
    """rollout.quantization=fp8 under separate placement: the rollout actor quantizes what the
    broadcast brings (the receive path, not the in-place one) exactly as the one-process run
    quantizes in place, so the runs agree."""
    fp8 = ("rollout.quantization=fp8",)
    run(cfg_for(tiny_moe_checkpoint, tmp_path / "inline", *fp8))
    separate = (
        "cluster.mode=ray",
        "cluster.placement=separate",
        "cluster.num_workers=1",
        "cluster.rollout_workers=1",
    )
    run(cfg_for(tiny_moe_checkpoint, tmp_path / "separate", *fp8, *separate))
    assert_same_run(tmp_path / "inline", tmp_path / "separate")
    gaps = [r["rollout/logp_gap_abs"] for r in metrics(tmp_path / "separate")[1:]]
    assert min(gaps) > 3e-5  # the rollout sampled from fp8 experts (bf16 would agree to ~2e-7)
