"""The broadcast sender in one process, its transport replaced: when a bucket cannot be sent, the
sender still goes through every remaining bucket of the training engine (the other training ranks
gather the weights with it) and then raises WeightSyncError; a sender that yields experts its
owner-only layout gives another rank fails the sync (and passes when it yields only its own); the
send plan belongs to its sync group and to one training layout; without a layout every rank exports
full tensors."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist

from rlloom.engines.train.base import WeightLayout
from rlloom.weight_sync import broadcast, outbox, wire
from rlloom.weight_sync.base import WeightSyncError
from rlloom.weight_sync.broadcast import SyncGroup, SyncGroupSpec, owner_layout, send_weights
from rlloom.weight_sync.group import Link
from rlloom.weight_sync.reshard import RankLayout, TrainLayout, full_box, plan_reshard
from tests.weight_sync.ep_phase import counting_all_gathers
from tests.weight_sync.sync_helpers import TrainSide, expert_of


class CountingSide(TrainSide):
    def __init__(self) -> None:
        super().__init__("dense")
        self.buckets = self.total = 0

    def named_weights(
        self, *, bucket_bytes: int, dtype: torch.dtype | None = None, owned_only: bool = False, **kw
    ):
        for bucket in super().named_weights(
            bucket_bytes=bucket_bytes, dtype=dtype, owned_only=owned_only, **kw
        ):
            self.buckets += 1
            yield bucket


def test_a_lost_rollout_rank_still_lets_the_sender_go_through_every_bucket(monkeypatch):
    side = CountingSide()
    shapes = {n: tuple(t.shape) for n, t in side.weights().items()}
    hello = wire.encode_layout(
        RankLayout(shapes=shapes, boxes={n: full_box(s) for n, s in shapes.items()}), torch.float32
    )

    def exchange(links, payloads, *, root, **kwargs):
        return [hello] if root == 1 else payloads

    def lost(link, tensor, root):
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(broadcast, "exchange", exchange)
    monkeypatch.setattr(outbox, "post_broadcast", lost)
    spec = SyncGroupSpec(host="127.0.0.1", port=0, num_senders=1, num_receivers=1)
    group = SyncGroup(
        spec=spec, rank=0, device=torch.device("cpu"), links={(0, 0): Link(pg=None, local_rank=0)}
    )
    with pytest.raises(WeightSyncError, match="Connection closed by peer.*keeps its previous weights"):
        send_weights(group, side, bucket_bytes=4 << 10)
    expected = sum(1 for _ in TrainSide("dense").named_weights(bucket_bytes=4 << 10))
    assert side.buckets == expected > 3 and group.broken


def _lone_sender(monkeypatch, shapes: dict) -> SyncGroup:
    """Sync rank 0 of 2 senders, its rollout (one tp rank holding everything) and transport faked."""
    hello = wire.encode_layout(
        RankLayout(shapes=shapes, boxes={n: full_box(s) for n, s in shapes.items()}), torch.float32
    )
    monkeypatch.setattr(
        broadcast, "exchange", lambda links, payloads, *, root, **kw: [hello] if root == 1 else payloads
    )
    monkeypatch.setattr(outbox, "post_broadcast", lambda link, tensor, root: None)
    for module in (broadcast, outbox):
        monkeypatch.setattr(module, "wait_all", lambda works, deadline, what: None)
    spec = SyncGroupSpec(host="127.0.0.1", port=0, num_senders=2, num_receivers=1)
    return SyncGroup(
        spec=spec, rank=0, device=torch.device("cpu"), links={(0, 0): Link(pg=None, local_rank=0)}
    )


def test_a_sender_yielding_experts_its_layout_gives_another_rank_fails_the_sync(monkeypatch):
    side = TrainSide("moe")  # yields every expert, as if its EP all-gather still ran
    shapes = {n: tuple(t.shape) for n, t in side.weights().items()}
    experts = {n: expert_of(n) // 2 for n in shapes if expert_of(n) is not None}  # experts 2, 3 on EP rank 1
    layout = TrainLayout.owned(shapes, experts, (0, 1))
    group = _lone_sender(monkeypatch, shapes)
    with pytest.raises(
        WeightSyncError, match="yielded 12 tensors that the training layout does not give.*fix:"
    ):
        send_weights(group, side, bucket_bytes=4 << 10, layout=layout)
    # yielding only its own experts (as `named_weights(owned_only=True)` does) the same sync goes through
    side.skip = {n for n, ep_rank in experts.items() if ep_rank == 1}
    report = send_weights(_lone_sender(monkeypatch, shapes), side, bucket_bytes=4 << 10, layout=layout)
    sent = {expert_of(k) for k in report.checksums} - {None}
    assert report.num_bytes > 0 and sent <= {0, 1}


def test_owner_layout_is_none_without_expert_or_tensor_parallelism():
    layouts = {"w": WeightLayout("w", (2, 2), None, None, (), ())}
    assert owner_layout(layouts, 0, 0) is None


def _experts_sent(report) -> set[int]:
    return {expert_of(k) for k in report.checksums} - {None}


def _send_owned(monkeypatch, group: SyncGroup, side: TrainSide, experts: dict[str, int]):
    """Sender 0 yields only the experts `experts` (name -> EP rank) puts on EP rank 0, and sends."""
    layout = TrainLayout.owned({n: tuple(t.shape) for n, t in side.weights().items()}, experts, (0, 1))
    side.skip = {n for n, ep_rank in experts.items() if ep_rank != 0}
    return send_weights(group, side, bucket_bytes=4 << 10, checksum=True, layout=layout)


def test_two_layouts_in_one_process_never_share_a_plan(monkeypatch):
    side = TrainSide("moe")
    shapes = {n: tuple(t.shape) for n, t in side.weights().items()}
    low = {n: expert_of(n) // 2 for n in shapes if expert_of(n) is not None}  # experts 0, 1 on EP rank 0
    high = {n: 1 - ep_rank for n, ep_rank in low.items()}  # experts 2, 3 on EP rank 0
    plans = []
    monkeypatch.setattr(outbox, "plan_reshard", lambda *a, **k: plans.append(1) or plan_reshard(*a, **k))
    group = _lone_sender(monkeypatch, shapes)
    assert _experts_sent(_send_owned(monkeypatch, group, side, low)) == {0, 1}
    # the first layout is gone (its id free for reuse); a new one on the same group gets its own plan
    gc.collect()
    assert _experts_sent(_send_owned(monkeypatch, group, side, high)) == {2, 3}
    # an equal layout built anew reuses the group's plan; another group plans for itself
    assert _experts_sent(_send_owned(monkeypatch, group, side, dict(high))) == {2, 3}
    other = _lone_sender(monkeypatch, shapes)
    assert _experts_sent(_send_owned(monkeypatch, other, side, low)) == {0, 1}
    assert len(plans) == 3 and group.plan is not other.plan
    assert _experts_sent(_send_owned(monkeypatch, group, side, high)) == {2, 3}  # each keeps its own


class OwnedOnlyRecorder(TrainSide):
    """A source that records the `owned_only` of every export the sync asked for."""

    def __init__(self) -> None:
        super().__init__("moe")
        self.owned_only: list[bool] = []

    def named_weights(
        self, *, bucket_bytes: int, dtype: torch.dtype | None = None, owned_only: bool = False, **kw
    ):
        self.owned_only.append(owned_only)
        return super().named_weights(bucket_bytes=bucket_bytes, dtype=dtype, owned_only=owned_only, **kw)


def test_without_a_layout_every_rank_exports_full_tensors_with_one_owner_only(monkeypatch):
    side = OwnedOnlyRecorder()
    shapes = {n: tuple(t.shape) for n, t in side.weights().items()}
    # no layout: full tensors (routed experts all-gathered over EP), the plan splits them by bytes
    report = send_weights(_lone_sender(monkeypatch, shapes), side, bucket_bytes=4 << 10, checksum=True)
    send_weights(None, side, bucket_bytes=4 << 10)  # a rank outside the sync group gathers the same way
    assert side.owned_only == [False, False] and _experts_sent(report)
    experts = {n: expert_of(n) // 2 for n in shapes if expert_of(n) is not None}
    _send_owned(monkeypatch, _lone_sender(monkeypatch, shapes), side, experts)
    assert side.owned_only == [False, False, True]


def test_counting_all_gathers_puts_all_gather_back_even_when_the_block_raises():
    original = dist.all_gather
    with pytest.raises(KeyError), counting_all_gathers() as calls:
        assert dist.all_gather is not original
        raise KeyError("a failed sync")
    assert dist.all_gather is original and calls == [0]
