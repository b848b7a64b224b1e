"""Placement of training and rollout ranks, the config rules that guard it, the chunks generation is
streamed in, and the reductions that combine the metrics of several optimizer steps."""

from __future__ import annotations

import dataclasses

import pytest

from rlloom.cluster.placement import missing_room, plan_placement, replica_ranks
from rlloom.config import ConfigError, load_config
from rlloom.observability.metrics import Max, Mean, MetricsAccumulator, Sum
from rlloom.workers.train import update_metrics


def cfg(*overrides: str):
    return load_config("arithmetic_smoke", list(overrides))


def test_replicas_are_consecutive_runs_of_tp_ranks():
    assert replica_ranks(4, 1) == [[0], [1], [2], [3]]
    assert replica_ranks(4, 2) == [[0, 1], [2, 3]]
    assert replica_ranks(6, 3) == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(ValueError, match="rollout.tp=2"):
        replica_ranks(3, 2)


def test_colocated_shares_slots_and_separate_has_its_own():
    p = plan_placement(cfg("cluster.mode=ray", "cluster.num_workers=2"))
    assert p.colocated and p.train_slots == p.rollout_slots == [0, 1] and p.num_slots == 2
    assert p.replicas == [[0], [1]]
    p = plan_placement(
        cfg(
            "cluster.mode=ray",
            "cluster.placement=separate",
            "cluster.num_workers=2",
            "cluster.rollout_workers=3",
        )
    )
    assert not p.colocated and p.train_slots == [0, 1] and p.rollout_slots == [2, 3, 4]
    assert p.replicas == [[0], [1], [2]] and p.num_slots == 5
    assert p.node_groups == [[0], [1], [2], [3], [4]]


def test_node_groups_keep_tensor_and_expert_parallel_ranks_and_replicas_on_one_node():
    ray4 = ("cluster.mode=ray", "cluster.num_workers=4")
    assert plan_placement(cfg(*ray4, "parallel.tp=2")).node_groups == [[0, 1], [2, 3]]
    assert plan_placement(cfg(*ray4, "parallel.ep=4")).node_groups == [[0, 1, 2, 3]]
    # colocated: a slot's training and rollout ranks go together, so both groupings hold
    assert plan_placement(cfg(*ray4, "rollout.tp=2")).node_groups == [[0, 1], [2, 3]]
    separate = ("cluster.placement=separate", "cluster.rollout_workers=4", "rollout.tp=2")
    p = plan_placement(cfg(*ray4, *separate, "parallel.tp=2"))
    assert p.node_groups == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert sorted(s for g in p.node_groups for s in g) == list(range(p.num_slots))


def test_a_cluster_without_room_for_the_node_groups_is_named():
    """What a lost node leaves is checked before actors wait for a place (cluster/ray_slots.py)."""
    assert missing_room([1, 1], [1, 1]) is None
    assert missing_room([2, 1], [2, 1, 5]) is None
    assert (
        missing_room([1, 1], [1])
        == "it needs 2 slots (node groups of 1, 1), its alive nodes have 1 (the largest 1)"
    )
    assert (
        missing_room([2], [1, 1])
        == "it needs 2 slots (node groups of 2), its alive nodes have 2 (the largest 1)"
    )
    assert missing_room([1], []) is not None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["cluster.mode=ray", "cluster.placement=separate"],
            r"cluster.rollout_workers=0 is invalid: cluster.placement=separate needs at least one rollout",
        ),
        (
            ["cluster.placement=separate", "cluster.rollout_workers=1"],
            r"cluster.mode='inline' is invalid: .*needs Ray. Fix: set cluster.mode=ray",
        ),
        (
            ["cluster.mode=ray", "cluster.rollout_workers=2"],
            r"cluster.rollout_workers=2 is invalid: with cluster.placement=colocated .* Fix: set cluster.rollout_workers=0",
        ),
        (["cluster.placement=apart"], r"cluster.placement"),
    ],
)
def test_placement_settings_are_checked_with_one_line_errors(overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        cfg(*overrides)
    assert "\n" not in str(e.value)


def test_rollout_ranks_must_split_into_whole_replicas(monkeypatch):
    from rlloom.config import ClusterConfig, RolloutConfig

    base = cfg()
    # rollout.tp arrives with the tensor-parallel rollout engine; stand it in on the class.
    monkeypatch.setattr(RolloutConfig, "tp", 2, raising=False)

    def with_cluster(**kw):
        return dataclasses.replace(base, cluster=ClusterConfig(mode="ray", **kw))

    with pytest.raises(ConfigError, match=r"cluster.rollout_workers=3 is invalid: .*multiple of 2"):
        with_cluster(placement="separate", rollout_workers=3)
    with pytest.raises(ConfigError, match=r"cluster.num_workers=3 is invalid: .*multiple of 2"):
        with_cluster(num_workers=3)
    p = plan_placement(with_cluster(placement="separate", rollout_workers=4))
    assert p.replicas == [[0, 1], [2, 3]] and p.rollout_slots == [1, 2, 3, 4]
    assert plan_placement(with_cluster(num_workers=4)).replicas == [[0, 1], [2, 3]]


def test_generation_chunks_cover_the_prompts_once():
    pytest.importorskip("ray")
    from rlloom.cluster.ray_generate import chunk_bounds

    assert chunk_bounds(10, 1) == [(0, 10)] and chunk_bounds(10, 1, 100) == [(0, 10)]
    for args, count in [((10, 2), 8), ((64, 2, 32), 2), ((1024, 2, 32), 8), ((100, 2, 30), 3), ((3, 4), 3)]:
        chunks = chunk_bounds(*args)
        assert len(chunks) == count, args
        assert chunks[0][0] == 0 and chunks[-1][1] == args[0]
        assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(chunks, chunks[1:]))
    # Chunks fill an engine's batch (32 prompts here) unless a replica would be left idle.
    assert chunk_bounds(64, 2, 32) == [(0, 32), (32, 64)] and chunk_bounds(0, 2) == []


def test_optimizer_step_metrics_combine_with_their_reductions():
    steps = [
        {
            "train/tokens": 100.0,
            "train/response_tokens": 30.0,
            "loss/clipfrac_high": 0.5,
            "train/grad_norm": 2.0,
        },
        {
            "train/tokens": 50.0,
            "train/response_tokens": 10.0,
            "loss/clipfrac_high": 0.1,
            "train/grad_norm": 4.0,
        },
    ]
    steps[0]["memory/peak_rss_gib"], steps[1]["memory/peak_rss_gib"] = 3.0, 5.0
    records = [update_metrics(s) for s in steps]
    assert isinstance(records[0]["train/tokens"], Sum) and isinstance(records[0]["memory/peak_rss_gib"], Max)
    assert records[0]["loss/clipfrac_high"] == Mean(0.5, weight=30.0)
    acc = MetricsAccumulator()
    acc.add_all(records)
    got = acc.summary()
    assert got["train/tokens"] == 150.0 and got["train/response_tokens"] == 40.0  # a sum stays a sum
    assert got["memory/peak_rss_gib"] == 5.0  # a max stays a max
    assert got["loss/clipfrac_high"] == pytest.approx((0.5 * 30 + 0.1 * 10) / 40)  # per token
    assert got["train/grad_norm"] == 3.0  # per optimizer step
