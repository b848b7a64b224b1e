"""The sending side's work of one broadcast sync (broadcast.py describes the protocol) between the
wire messages: `send_plan`, which sender sends which slice of each tensor to which rollout tp rank,
in which buckets (kept on the sync group while its inputs stay the same), and `Outbox`, which packs
the tensors the training engine yields into those buckets and broadcasts each once complete."""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlloom.weight_sync.checksum import digest, piece_key
from rlloom.weight_sync.group import Link, SendPlan, SyncGroup, post_broadcast, wait_all
from rlloom.weight_sync.reshard import (
    Box,
    Bucket,
    RolloutLayout,
    TrainLayout,
    box_numel,
    box_shape,
    plan_reshard,
    relative,
)
from rlloom.weight_sync.wire import decode_layout

MAX_IN_FLIGHT = 3
"""Buckets a sender has posted to one group and not yet seen taken (a bound on its buffers)."""


def send_plan(
    group: SyncGroup,
    layout: TrainLayout | None,
    hello: tuple[bytes, ...],
    bucket_bytes: int,
    dtype: torch.dtype | None,
) -> SendPlan:
    """The group's plan for a sync with these inputs: the one it keeps when they are the same as last
    time (by value), else a new one, which the group then keeps. Raises ValueError when the layouts
    disagree."""
    if group.plan is not None and group.plan.fits(layout, hello, bucket_bytes, dtype):
        return group.plan
    ranks = [decode_layout(h) for h in hello]
    rollout = RolloutLayout(ranks=tuple(rank for rank, _ in ranks))
    wire_dtype = dtype or ranks[0][1]
    train = layout or TrainLayout.replicated(rollout.shapes, group.spec.num_senders)
    plan = plan_reshard(train, rollout, bucket_numel=max(1, bucket_bytes // wire_dtype.itemsize))
    group.plan = SendPlan(
        layout=layout,
        hello=hello,
        bucket_bytes=bucket_bytes,
        requested=dtype,
        dtype=wire_dtype,
        shapes=rollout.shapes,
        routes=tuple(plan.route(group.rank, r) for r in range(len(hello))),
        held={n: box for n, owners in train.owners.items() for r, box in owners if r == group.rank},
    )
    return group.plan


class Outbox:
    """The sender's buckets: filled as tensors arrive, each broadcast once complete (in plan order)."""

    def __init__(
        self,
        routes: list[tuple[Bucket, ...]],
        links: list[Link],
        *,
        dtype: torch.dtype,
        device: torch.device,
        checksum: bool,
        deadline: float,
    ) -> None:
        self.routes, self.links, self.dtype, self.device = routes, links, dtype, device
        self.checksum, self.deadline = checksum, deadline
        self.slots: dict[str, list[tuple[int, int, int, Box]]] = {}
        self.remaining: dict[tuple[int, int], int] = {}
        for r, route in enumerate(routes):
            for b, bucket in enumerate(route):
                offset = 0
                for piece in bucket.pieces:
                    self.slots.setdefault(piece.name, []).append((r, b, offset, piece.box))
                    offset += piece.numel
                self.remaining[(r, b)] = len(bucket.pieces)
        self.buffers: dict[tuple[int, int], torch.Tensor] = {}
        self.next = [0] * len(routes)
        self.in_flight: list[list[dist.Work]] = [[] for _ in routes]
        self.checksums: list[dict[str, str]] = [{} for _ in routes]
        self.seen: set[str] = set()
        self.unexpected: list[str] = []
        """Tensors yielded that the training layout does not give this sender."""
        self.problems: list[str] = []
        self.num_bytes = self.num_pieces = 0

    def _buffer(self, r: int, b: int) -> torch.Tensor:
        if (r, b) not in self.buffers:
            numel = self.routes[r][b].numel
            self.buffers[(r, b)] = torch.empty(numel, dtype=self.dtype, device=self.device)
        return self.buffers[(r, b)]

    def put(
        self, name: str, tensor: torch.Tensor, shapes: dict[str, tuple[int, ...]], held: dict[str, Box]
    ) -> None:
        """Copy this sender's pieces of `name` out of `tensor` (its box `held[name]` of the full
        tensor, of full shape `shapes[name]`) into their buckets; broadcast the buckets now complete."""
        if name in self.seen:
            self.problems.append(f"the training engine yielded {name!r} twice")
            return
        self.seen.add(name)
        if name not in shapes:
            self.problems.append(
                f"the training engine yielded {name!r}, which the rollout model does not have"
            )
            return
        if name not in held:
            self.unexpected.append(name)
            return
        within = held[name]
        if tuple(tensor.shape) != box_shape(within):
            self.problems.append(
                f"{name!r} has shape {list(tensor.shape)} in training, but the training layout gives this "
                f"sender its box {list(within)} of the rollout's {list(shapes[name])}"
            )
            return
        for r, b, offset, box in self.slots.get(name, []):
            view = self._buffer(r, b).narrow(0, offset, box_numel(box)).view(box_shape(box))
            view.copy_(tensor[tuple(slice(start, stop) for start, stop in relative(box, within))])
            if self.checksum:
                self.checksums[r][piece_key(name, box)] = digest(view)
            self.remaining[(r, b)] -= 1
            self._flush(r)

    def _flush(self, r: int) -> None:
        route = self.routes[r]
        while self.next[r] < len(route) and self.remaining[(r, self.next[r])] == 0:
            buf = self._buffer(r, self.next[r])
            self.in_flight[r].append(post_broadcast(self.links[r], buf, root=0))
            self.num_bytes += buf.numel() * buf.element_size()
            self.num_pieces += len(route[self.next[r]].pieces)
            del self.buffers[(r, self.next[r])]  # the work keeps it alive until sent
            self.next[r] += 1
            if len(self.in_flight[r]) > MAX_IN_FLIGHT:
                wait_all([self.in_flight[r].pop(0)], self.deadline, "a rollout rank to take a bucket")

    def finish(self, held: dict[str, Box]) -> None:
        """Send what is left (buckets with tensors the engine never yielded go out as zeros, so the
        receivers' streams stay in step; the trailer says the sync failed). `held`: the tensors the
        training layout gives this sender, all of which the engine must have yielded."""
        if self.unexpected:
            self.problems.append(
                f"the training engine yielded {len(self.unexpected)} tensors that the training layout does "
                f"not give this sender: {self.unexpected[:5]} (fix: pass the layout `owner_layout` builds "
                "from this engine's weight_layouts(), or layout=None to send full tensors)"
            )
        missing = sorted(set(held) - self.seen)
        if missing:
            self.problems.append(f"the training engine did not yield {len(missing)} tensors: {missing[:5]}")
        for key, left in self.remaining.items():
            if left:  # never filled whole: zeros, not the allocator's leftovers, go out
                self._buffer(*key).zero_()
            self.remaining[key] = 0
        for r in range(len(self.routes)):
            self._flush(r)
