"""The broadcast weight sync's failure rules on Ray, with stand-in actors (no Ray start): a sync that
fails with every actor alive is retried once in a fresh sync group; a lost rollout actor is replaced
first; a lost training actor, or a second failure, goes up to the controller."""

from __future__ import annotations

import pytest

pytest.importorskip("ray", reason="needs the ray extra: pip install 'rlloom[ray]'")

from rlloom.cluster.ray import BroadcastSync, RayTrainGroup  # noqa: E402
from rlloom.cluster.ray_rollout import RayRolloutGroup  # noqa: E402
from rlloom.cluster.ray_slots import SlotFailure  # noqa: E402
from rlloom.config import load_config  # noqa: E402

SENT = {"sync/gb": 1.0, "sync/num_tensors": 2.0, "sync/ms": 3.0, "sync/ms_per_gb": 3.0}


class FakeSlot:
    def __init__(self, slot: int, log: list) -> None:
        self.join_sync = FakeMethod("join_sync", slot, log)


class FakeMethod:
    def __init__(self, name: str, slot: int, log: list) -> None:
        self.name, self.slot, self.log = name, slot, log

    def remote(self, *args):
        self.log.append((self.name, self.slot))
        return (self.name, self.slot)


class FakeActors:
    """Slots 0 (training) and 1 (rollout); the syncs fail as `failures` says, in turn."""

    def __init__(self, failures: list[SlotFailure]) -> None:
        self.failures, self.log = failures, []
        self.slots = [FakeSlot(s, self.log) for s in range(2)]

    def call(self, slots, method, *args):
        return [FakeMethod(method, s, self.log).remote() for s in slots]

    def wait(self, refs, stage, slots):
        if stage == "sync" and self.failures:
            raise self.failures.pop(0)
        values = {"send_weights": SENT, "receive_weights": 7, "address": ("host", 1234, 1, "node", "cpu")}
        return [values.get(name) for name, _ in refs]


def sync_of(
    failures: list[SlotFailure], recovered: list[int] | None = None
) -> tuple[BroadcastSync, FakeActors]:
    cfg = load_config(
        "arithmetic_smoke", ["cluster.mode=ray", "cluster.placement=separate", "cluster.rollout_workers=1"]
    )
    actors = FakeActors(failures)
    recover = None if recovered is None else recovered.append
    rollout = RayRolloutGroup(actors, [[1]], max_num_seqs=4, max_restarts=3, recover=recover)
    return BroadcastSync(cfg, RayTrainGroup(actors, [0]), rollout), actors


def test_a_failed_sync_with_live_actors_is_retried_once_in_a_fresh_group():
    sync, actors = sync_of([SlotFailure("rollout rank 0 failed in stage 'sync'", [1], lost=False)])
    assert sync.sync() == SENT and sync.rollout.version == 7
    assert actors.log == [
        *[("send_weights", 0), ("receive_weights", 1)],  # the failed sync
        *[("address", 0), ("join_sync", 0), ("join_sync", 1)],  # a fresh sync group for all
        *[("send_weights", 0), ("receive_weights", 1)],  # the retry
    ]
    sync, _ = sync_of([SlotFailure("first", [1], lost=False), SlotFailure("second", [1], lost=False)])
    with pytest.raises(SlotFailure, match="second"):
        sync.sync()


def test_a_lost_rollout_actor_is_replaced_and_a_lost_training_actor_goes_up():
    recovered: list[int] = []
    sync, _ = sync_of([SlotFailure("rollout rank 0 died", [1])], recovered)
    assert sync.sync() == SENT and recovered == [0] and sync.rollout.restarts == 1
    sync, actors = sync_of([SlotFailure("training rank 0 died", [0])], [])
    with pytest.raises(SlotFailure, match="training rank 0 died"):
        sync.sync()
    assert ("join_sync", 0) not in actors.log
