"""The broadcast sender in one process, its transport replaced: when a bucket cannot be sent, the
sender still goes through every remaining bucket of the training engine (the other training ranks
gather the weights with it) and then raises WeightSyncError; a sender that yields experts its
owner-only layout gives another rank fails the sync (and passes when it yields only its own)."""

from __future__ import annotations

import pytest
import torch

from rlloom.engines.train.native.weights import WeightLayout
from rlloom.weight_sync import broadcast, wire
from rlloom.weight_sync.base import WeightSyncError
from rlloom.weight_sync.broadcast import SyncGroup, SyncGroupSpec, owner_layout, send_weights
from rlloom.weight_sync.group import Link
from rlloom.weight_sync.reshard import RankLayout, TrainLayout, full_box
from tests.weight_sync.sync_helpers import TrainSide, expert_of


class CountingSide(TrainSide):
    def __init__(self) -> None:
        super().__init__("dense")
        self.buckets = self.total = 0

    def named_weights(self, *, bucket_bytes: int, dtype: torch.dtype | None = None, owned_only: bool = False):
        for bucket in super().named_weights(bucket_bytes=bucket_bytes, dtype=dtype, owned_only=owned_only):
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
    monkeypatch.setattr(broadcast, "post_broadcast", lost)
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
    monkeypatch.setattr(broadcast, "post_broadcast", lambda link, tensor, root: None)
    monkeypatch.setattr(broadcast, "wait_all", lambda works, deadline, what: None)
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
    with pytest.raises(WeightSyncError, match="yielded 12 tensors that the training layout does not give"):
        send_weights(group, side, bucket_bytes=4 << 10, layout=layout)
    # yielding only its own experts (as `named_weights(owned_only=True)` does) the same sync goes through
    side.skip = {n for n, ep_rank in experts.items() if ep_rank == 1}
    report = send_weights(_lone_sender(monkeypatch, shapes), side, bucket_bytes=4 << 10, layout=layout)
    sent = {expert_of(k) for k in report.checksums} - {None}
    assert report.num_bytes > 0 and sent <= {0, 1}


def test_owner_layout_is_none_without_expert_parallelism():
    layouts = {"w": WeightLayout("w", (2, 2), None, None, (), ())}
    assert owner_layout(layouts, 0) is None
