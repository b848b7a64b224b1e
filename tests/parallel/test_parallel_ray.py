"""The whole RL run through `run(cfg)` with 2 Ray workers in a tensor- and expert-parallel training
layout (the experts split over the tensor-parallel ranks; expert parallelism over data-parallel
ranks runs on gloo in test_train_parallel_gloo.py) gives the one-process run's per-step metrics
(loss, grad norm, rewards, entropy, ...) within rel 1e-4, colocated and with a rollout pool of its
own. The learning rate (3e-2) is large enough that a wrong gradient changes the weights, hence the
later samples; the random tiny model earns no reward, so an entropy bonus gives the gradient. The
KL term runs the frozen reference in the same layout, and the MoE routes of the rollout are
replayed; with separate placement both ranks send the rollout what they own (owner-only weight
sync): their experts and their tensor-parallel shards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="needs the ray extra: pip install 'rlloom[ray]'")

from rlloom.config import load_config  # noqa: E402
from rlloom.trainer.run import run  # noqa: E402

pytestmark = pytest.mark.usefixtures("ray_cluster")  # the session's one Ray instance
SKIP = ("time/", "perf/", "sync/ms", "memory/", "sync/num_tensors")  # owner-only: a TP shard is a piece


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
            "rollout.max_new_tokens=6",
            "train.lr=3e-2",
            "algorithm.kl_coef=0.05",
            "algorithm.routing_replay=rollout",
            "algorithm.entropy_coef=0.01",  # rewards of a random model are 0: the entropy term trains it
            "logging.console=false",
            "rollout.kv_cache_memory_gb=0.05",  # per rank: 200k tokens of the tiny model, not 1 GiB to zero
            *extra,
        ],
    )


def metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(SKIP)} for r in rows]


@pytest.fixture(scope="module")
def one_process(tiny_moe_checkpoint, tmp_path_factory) -> list[dict]:
    run_dir = tmp_path_factory.mktemp("inline")
    run(cfg_for(tiny_moe_checkpoint, run_dir))
    return metrics(run_dir)


@pytest.mark.parametrize(
    "layout",
    [
        # colocated: each rank's rollout gathers the full weights (attention's TP shards and the
        # experts, split over the TP ranks) in its own process
        "parallel.tp=2 parallel.ep=2",
        # a rollout pool of its own: both ranks send what they own (owner-only weight sync): their
        # expert-parallel rank's experts and their tensor-parallel shards of attention and the head
        "parallel.tp=2 parallel.ep=2 cluster.placement=separate cluster.rollout_workers=1",
    ],
)
def test_two_ray_workers_in_a_parallel_layout_match_one_process(
    tiny_moe_checkpoint, tmp_path, one_process, layout
):
    run(cfg_for(tiny_moe_checkpoint, tmp_path, "cluster.mode=ray", "cluster.num_workers=2", *layout.split()))
    got = metrics(tmp_path)
    assert [r["step"] for r in got] == [r["step"] for r in one_process] == [0, 1, 2, 3]
    for expected, row in zip(one_process, got):
        assert expected.keys() == row.keys()
        if row["step"] > 0:
            assert {"train/loss", "train/grad_norm", "reward/mean", "actor/entropy"} <= row.keys()
        for k in expected:
            assert row[k] == pytest.approx(expected[k], rel=1e-4, abs=1e-6), (layout, row["step"], k)
    assert all(r["train/grad_norm"] > 0 for r in got[1:])
