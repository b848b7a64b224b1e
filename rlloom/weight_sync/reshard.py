"""The reshard plan: which training rank sends which slice of each Hugging Face-named tensor to which
rollout tensor-parallel rank, in buckets. Pure data in, data out.

Both layouts describe slices as boxes (a [start, stop) range per dim) of the FULL tensor:

- `TrainLayout`: for each tensor, in the order the training engine yields them, the training ranks
  (of the sync group's senders) and the box each holds. FSDP shards are boxes along dim 0, TP shards
  along the split dim, an expert's tensor is held whole by its EP rank (and FSDP-sharded over what EP
  leaves). Identical boxes on several ranks are replicas (data parallel, or a full tensor gathered
  on every rank): the plan picks one of them to send, balancing bytes. `TrainLayout.owned` is what
  the training engine's owner-only export gives: a tensor-parallel shard on every sender of its tp
  rank (its box along the TP shard dim), each routed expert whole on the senders of its EP rank
  only (never all-gathered over EP or TP), every other tensor whole on every sender.
- `RolloutLayout`: one replica of `tp` ranks, each stating its box of every tensor it holds (a
  `RankLayout`; the engine's `weight_shard_slices()`): column-parallel projections (q/k/v,
  gate/up) split dim 0, row-parallel ones (o, down) dim 1, the vocabulary-parallel embedding and
  head dim 0, norms and MLA's q_a/kv_a whole on every rank; an expert only on the ranks that
  serve it. `RolloutLayout.split` builds the even (torch.chunk) case.

`plan_reshard` intersects them: every element of every rollout rank's box is sent exactly once, by
a rank that holds it, and lands only on the rollout ranks that hold it (never every expert on
every rank). Pieces going from one sender to one rollout TP rank are packed, in the training
engine's order, into buckets of at most `bucket_numel` elements (a larger piece travels alone), so
a sender can fill a bucket as its tensors arrive and send it when full.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

Box = tuple[tuple[int, int], ...]
"""A slice of a tensor: [start, stop) per dim, in the coordinates of the full tensor."""


def full_box(shape: Iterable[int]) -> Box:
    return tuple((0, n) for n in shape)


def chunk_box(shape: tuple[int, ...], dim: int, index: int, parts: int) -> Box:
    """The box of `tensor.chunk(parts, dim)[index]` (torch's chunk sizes: ceil(n / parts), the last
    ones shorter or empty), as FSDP2's Shard(dim) and the rollout's TP split both cut."""
    size = -(-shape[dim] // parts)
    start, stop = min(index * size, shape[dim]), min((index + 1) * size, shape[dim])
    return tuple((start, stop) if d == dim else (0, n) for d, n in enumerate(shape))


def box_numel(box: Box) -> int:
    return math.prod(stop - start for start, stop in box)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in box)


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes of the same tensor, or None when it is empty."""
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b, strict=True))
    return out if all(start < stop for start, stop in out) else None


def relative(box: Box, within: Box) -> Box:
    """`box` in the coordinates of `within` (which contains it)."""
    return tuple((s - w0, e - w0) for (s, e), (w0, _) in zip(box, within, strict=True))


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainLayout:
    """Where the training weights live. Example (2 FSDP ranks, one tensor):
    `TrainLayout(shapes={"w": (4, 2)}, owners={"w": ((0, ((0, 2), (0, 2))), (1, ((2, 4), (0, 2))))})`."""

    shapes: dict[str, tuple[int, ...]]
    """Full shape of every tensor, in the order the training engine yields them."""
    owners: dict[str, tuple[tuple[int, Box], ...]]
    """Per tensor: (sender rank, box it holds). Boxes are identical (replicas) or disjoint."""

    @classmethod
    def replicated(cls, shapes: dict[str, tuple[int, ...]], num_senders: int) -> TrainLayout:
        """Every sender holds every full tensor (today's engines gather each tensor on every rank)."""
        return cls(
            shapes=dict(shapes),
            owners={n: tuple((r, full_box(s)) for r in range(num_senders)) for n, s in shapes.items()},
        )

    @classmethod
    def owned(
        cls,
        shapes: dict[str, tuple[int, ...]],
        expert_ep_ranks: Mapping[str, int],
        sender_ep_ranks: Sequence[int],
        tp_shards: Mapping[str, tuple[int, int]] | None = None,
        sender_tp_ranks: Sequence[int] | None = None,
    ) -> TrainLayout:
        """What the senders hold when each yields `named_weights(owned_only=True)`: a routed expert
        (`expert_ep_ranks[name]`: the EP rank holding it) whole on every sender of that EP rank (the
        replicas its expert-FSDP gather leaves); a tensor-parallel tensor (`tp_shards[name]` = (dim,
        tp)) as `torch.chunk(full, tp, dim)[t]` on every sender of tp rank t (the replicas its FSDP
        gather leaves); every other tensor whole on every sender. `sender_ep_ranks[s]` and
        `sender_tp_ranks[s]` (default all 0): the EP and TP ranks of sender s. Raises ValueError
        when no sender holds an expert's EP rank or a TP shard (the senders must be every training
        rank)."""
        tp_shards = tp_shards or {}
        tp_ranks = tuple(sender_tp_ranks) if sender_tp_ranks is not None else (0,) * len(sender_ep_ranks)
        missing = {t for _, tp in tp_shards.values() for t in range(tp)} - set(tp_ranks)
        if missing:
            raise ValueError(
                f"owner-only weight sync: the senders hold tp ranks {sorted(set(tp_ranks))}, none holds tp "
                f"ranks {sorted(missing)} of the tensor-parallel tensors. Fix: make every training rank a sender."
            )
        everyone = tuple(range(len(sender_ep_ranks)))
        by_ep: dict[int, tuple[int, ...]] = {}
        for sender, ep_rank in enumerate(sender_ep_ranks):
            by_ep[ep_rank] = (*by_ep.get(ep_rank, ()), sender)
        owners = {}
        for name, shape in shapes.items():
            ep_rank = expert_ep_ranks.get(name)
            ranks = everyone if ep_rank is None else by_ep.get(ep_rank, ())
            if not ranks:
                raise ValueError(
                    f"owner-only weight sync: expert tensor {name!r} lives on EP rank {ep_rank}, but the "
                    f"senders hold EP ranks {sorted(by_ep)}. Fix: make every training rank a sender."
                )
            shard = tp_shards.get(name)
            owners[name] = tuple(
                (r, full_box(shape) if shard is None else chunk_box(shape, shard[0], tp_ranks[r], shard[1]))
                for r in ranks
            )
        return cls(shapes=dict(shapes), owners=owners)

    @classmethod
    def sharded(
        cls, shapes: dict[str, tuple[int, ...]], placement: dict[str, tuple[int, ...]], *, dim: int = 0
    ) -> TrainLayout:
        """Each tensor split along `dim` over the ranks `placement[name]` lists (FSDP's Shard(0) over
        its ranks; an expert's tensor over the FSDP ranks of the EP rank that holds it; a single rank
        holds a tensor whole)."""
        owners = {
            n: tuple((r, chunk_box(s, dim, i, len(placement[n]))) for i, r in enumerate(placement[n]))
            for n, s in shapes.items()
        }
        return cls(shapes=dict(shapes), owners=owners)


@dataclass(frozen=True, kw_only=True, slots=True)
class RankLayout:
    """What one rollout rank holds. Example (rank 1 of tp=2, a column-parallel q and a norm):
    `RankLayout(shapes={"q": (8, 4), "norm": (4,)}, boxes={"q": ((4, 8), (0, 4)), "norm": ((0, 4),)})`."""

    shapes: dict[str, tuple[int, ...]]
    """Full shape of every tensor the rollout model loads."""
    boxes: dict[str, Box]
    """The part of each tensor this rank holds (absent: none of it, e.g. an expert placed elsewhere)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutLayout:
    """Where one rollout replica wants the weights: one `RankLayout` per tensor-parallel rank. Ranks
    may hold overlapping boxes (KV heads replicated when tp > KV heads) or padded slices: every rank
    states its own boxes, as the engine's `weight_shard_slices()` gives them."""

    ranks: tuple[RankLayout, ...]

    @property
    def tp(self) -> int:
        return len(self.ranks)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return self.ranks[0].shapes

    def box(self, name: str, tp_rank: int) -> Box | None:
        """What `tp_rank` holds of `name` (None: nothing)."""
        return self.ranks[tp_rank].boxes.get(name)

    @classmethod
    def split(
        cls,
        shapes: dict[str, tuple[int, ...]],
        tp: int,
        shard_dims: dict[str, int | None] | None = None,
        holders: dict[str, tuple[int, ...]] | None = None,
    ) -> RolloutLayout:
        """Tensors split evenly (torch.chunk) along `shard_dims[name]` over `tp` ranks (absent or None:
        every rank holds it whole), held only by the ranks `holders[name]` lists when given."""
        dims, holders = shard_dims or {}, holders or {}
        ranks = []
        for r in range(tp):
            boxes = {}
            for name, shape in shapes.items():
                if r in holders.get(name, range(tp)):
                    dim = dims.get(name)
                    boxes[name] = full_box(shape) if dim is None else chunk_box(shape, dim, r, tp)
            ranks.append(RankLayout(shapes=dict(shapes), boxes=boxes))
        return cls(ranks=tuple(ranks))


@dataclass(frozen=True, slots=True)
class Piece:
    """One box of one tensor, sent by one training rank to the rollout ranks of one tp rank."""

    name: str
    box: Box

    @property
    def numel(self) -> int:
        return box_numel(self.box)


@dataclass(frozen=True, kw_only=True, slots=True)
class Bucket:
    """Pieces that travel together in one flat buffer, from `sender` to rollout tp rank `tp_rank`."""

    sender: int
    tp_rank: int
    pieces: tuple[Piece, ...]

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.pieces)


@dataclass(frozen=True, kw_only=True, slots=True)
class ReshardPlan:
    """Every bucket of one sync, per (sender, tp rank) in the training engine's tensor order."""

    buckets: tuple[Bucket, ...]

    def route(self, sender: int, tp_rank: int) -> tuple[Bucket, ...]:
        """The buckets `sender` sends to (and the ranks of tp rank `tp_rank` receive from) it, in order."""
        return tuple(b for b in self.buckets if b.sender == sender and b.tp_rank == tp_rank)

    def sent_numel(self, sender: int) -> int:
        return sum(b.numel for b in self.buckets if b.sender == sender)


def _choose_owners(owners: tuple[tuple[int, Box], ...], load: dict[int, int]) -> list[tuple[int, Box]]:
    """One sender per distinct box: among the replicas of a box, the least-loaded rank (then the lowest)."""
    by_box: dict[Box, list[int]] = {}
    for rank, box in owners:
        by_box.setdefault(box, []).append(rank)
    chosen = []
    for box, ranks in by_box.items():
        rank = min(ranks, key=lambda r: (load.get(r, 0), r))
        load[rank] = load.get(rank, 0) + box_numel(box)
        chosen.append((rank, box))
    return chosen


def _pieces(train: TrainLayout, rollout: RolloutLayout) -> dict[tuple[int, int], list[Piece]]:
    if set(train.shapes) != set(rollout.shapes):
        missing, extra = (
            sorted(set(rollout.shapes) - set(train.shapes)),
            sorted(set(train.shapes) - set(rollout.shapes)),
        )
        raise ValueError(
            f"reshard plan: the training layout lacks {missing[:5]} and has {extra[:5]} that the rollout "
            "does not load. Fix: build both layouts from the same model."
        )
    routes: dict[tuple[int, int], list[Piece]] = {}
    load: dict[int, int] = {}
    for name, shape in train.shapes.items():
        if tuple(rollout.shapes[name]) != tuple(shape):
            raise ValueError(
                f"reshard plan: {name!r} has shape {list(shape)} in training but {list(rollout.shapes[name])} "
                "in the rollout. Fix: build both layouts from the same model."
            )
        owners = _choose_owners(train.owners[name], load)
        if sum(box_numel(b) for _, b in owners) != math.prod(shape):
            raise ValueError(
                f"reshard plan: the training ranks' boxes of {name!r} {owners} do not tile its shape "
                f"{list(shape)} exactly once. Fix: describe every shard of the training layout."
            )
        for tp_rank in range(rollout.tp):
            target = rollout.box(name, tp_rank)
            if target is None:
                continue
            for sender, box in owners:
                common = intersect(target, box)
                if common is not None:
                    routes.setdefault((sender, tp_rank), []).append(Piece(name, common))
    return routes


def _bucketed(sender: int, tp_rank: int, pieces: list[Piece], bucket_numel: int) -> list[Bucket]:
    buckets, current, size = [], [], 0
    for piece in pieces:
        if current and size + piece.numel > bucket_numel:
            buckets.append(Bucket(sender=sender, tp_rank=tp_rank, pieces=tuple(current)))
            current, size = [], 0
        current.append(piece)
        size += piece.numel
    if current:
        buckets.append(Bucket(sender=sender, tp_rank=tp_rank, pieces=tuple(current)))
    return buckets


def plan_reshard(train: TrainLayout, rollout: RolloutLayout, *, bucket_numel: int) -> ReshardPlan:
    """The buckets that move `train` into `rollout`: each rollout tp rank's box of every tensor is
    covered exactly once, by pieces from the training ranks that hold them. Raises ValueError when
    the layouts disagree (names, shapes) or the training boxes do not tile a tensor."""
    if bucket_numel < 1:
        raise ValueError(
            f"bucket_numel={bucket_numel} is invalid: must be >= 1. Fix: use sync.bucket_mb >= 1."
        )
    routes = _pieces(train, rollout)
    buckets = [b for (s, r), pieces in sorted(routes.items()) for b in _bucketed(s, r, pieces, bucket_numel)]
    return ReshardPlan(buckets=tuple(buckets))
