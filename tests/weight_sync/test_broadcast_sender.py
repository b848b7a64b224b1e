"""The broadcast sender in one process, its transport replaced: when a bucket cannot be sent, the
sender still goes through every remaining bucket of the training engine (the other training ranks
gather the weights with it) and then raises WeightSyncError."""

from __future__ import annotations

import pytest
import torch

from rlloom.weight_sync import broadcast
from rlloom.weight_sync.base import WeightSyncError
from rlloom.weight_sync.broadcast import SyncGroup, SyncGroupSpec, send_weights
from rlloom.weight_sync.group import Link
from rlloom.weight_sync.reshard import RankLayout, full_box
from tests.weight_sync.sync_helpers import TrainSide


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
    hello = broadcast._encode_layout(
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
