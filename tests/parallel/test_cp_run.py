"""The whole RL run through `run(cfg)` with 2 Ray workers in a context-parallel training layout
(parallel.cp=2) gives the one-process run's per-step metrics within rel 1e-4, with the settings of
test_parallel_ray (learning rate 3e-2, the KL reference in the same layout, MoE routes replayed)
and a dense reward (the share of digits: the tiny random model never answers right, so with the
task's reward nothing would train and a wrong gradient could not show); both runs pack without
shared prompts, which CP refuses."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("ray", reason="needs the ray extra: pip install 'rlloom[ray]'")

from test_parallel_ray import cfg_for, metrics  # noqa: E402

from rlloom.trainer.run import run  # noqa: E402

pytestmark = pytest.mark.usefixtures("ray_cluster")  # the session's one Ray instance

SETTINGS = (
    "train.share_prompts=false",
    "reward.name=resume_reward:digit_share",
    f"reward.import_dir={Path(__file__).resolve().parents[1] / 'trainer'}",
    "reward.num_workers=1",
)


@pytest.mark.slow
def test_two_ray_workers_with_context_parallelism_match_one_process(tiny_moe_checkpoint, tmp_path):
    run(cfg_for(tiny_moe_checkpoint, tmp_path / "one", *SETTINGS))
    expected = metrics(tmp_path / "one")
    ray = ("cluster.mode=ray", "cluster.num_workers=2", "parallel.cp=2")
    run(cfg_for(tiny_moe_checkpoint, tmp_path / "cp", *SETTINGS, *ray))
    got = metrics(tmp_path / "cp")
    assert [r["step"] for r in got] == [r["step"] for r in expected] == [0, 1, 2, 3]
    for want, row in zip(expected, got):
        assert want.keys() == row.keys()
        for k in want:
            assert row[k] == pytest.approx(want[k], rel=1e-4, abs=1e-6), (row["step"], k)
    assert all(r["train/grad_norm"] > 0 for r in got[1:])  # the policy moves...
    assert len({round(r["reward/mean"], 6) for r in got[1:]}) > 1  # ...and samples change
