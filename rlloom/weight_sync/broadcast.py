"""Weight sync between separate GPU pools: the training ranks that send and the rollout ranks that
receive join a sync group OUTSIDE both torch.distributed worlds (each side keeps its own world).

API (the workers call exactly these):

    spec = SyncGroupSpec(host=..., port=..., num_senders=S, num_receivers=R, rollout_tp=tp,
                         timeout_s=cfg.sync.timeout_s)
    group = join_sync_group(spec, rank, device)   # every member, at start-up; collective
        # ranks 0..S-1: the training ranks that send; S..S+R-1: the rollout ranks, rollout rank i
        # being tp rank i % tp of replica i // tp
    # once, on every training rank when all of them send (collective over the training world):
    layout = owner_layout(train_engine.weight_layouts(), train_engine.ep_rank, train_engine.tp_rank)
    # each sync, on every training rank (non-senders pass group=None: FSDP gathers are collective);
    # layout=None instead: every rank yields full tensors (routed experts all-gathered over EP):
    report = send_weights(group, train_engine, bucket_bytes=cfg.sync.bucket_mb << 20,
                          dtype=None, checksum=checksum_enabled(cfg.sync.checksum, device),
                          layout=layout)          # -> SyncReport
    # each sync, on every rollout rank, at the same time (receive.py):
    report = receive_weights(group, rollout_engine, checksum=...)   # -> SyncReport
    group.close()

How: `join_sync_group` (group.py) builds one process group per (sender s, rollout tp rank r),
joining s and the rollout ranks of tp rank r of every replica, from its own TCPStore:
`ProcessGroupNCCL` on GPU, `ProcessGroupGloo` on CPU, outside both worlds. Each sync, on each:
1. the first receiver of each tp rank broadcasts what that rank holds (names, full shapes, its
   slice of each, dtype: `checksum.rank_layout`) and every sender plans with
   `reshard.plan_reshard` (training layout: `layout`; default every sender holds every full
   tensor) who sends which slice: every sender computes the same plan from the same data, and
   keeps it on its `SyncGroup` (`group.plan`) for the next syncs while the inputs stay the same
   (`outbox.send_plan`);
2. the sender broadcasts a manifest: version, dtype, its buckets and their pieces (name, box);
3. then each bucket as one flat buffer (at most `bucket_bytes`), filled as the training engine
   yields its tensors, at most 3 in flight per group (`outbox.Outbox`); a rollout TP rank receives
   only its slices;
4. then a trailer: "ok" or what went wrong on the sender, and the content checksums.

Owner-only sending (`layout=owner_layout(...)`, under expert or tensor parallelism): every sender
iterates `named_weights(owned_only=True)`, which gathers FSDP shards (collectives, same order on
every training rank) but never all-gathers over the expert- or tensor-parallel ranks: each rank
yields its own routed experts, and its own TP shard of each tensor-parallel tensor (column-parallel
q/k/v and gate/up, vocabulary-parallel embedding and head, row-parallel o/down) under the tensor's
Hugging Face name. `owner_layout` says so to the plan (`TrainLayout.owned`): an expert is sent only
by a training rank of its EP rank, each TP shard's box (the chunk of the full tensor along its TP
dim for that tp rank) only by a rank of that tp rank (they share the work when the FSDP gather
leaves it on several: data-parallel replicas), a tensor replicated over TP (norms, routers, ...) by
one of all senders, balanced by bytes. A rollout rank then receives each of its slices from the
training ranks whose shards overlap it (a rollout.tp=1 rank from every tp rank, a rollout tp rank
matching the training tp from its peer alone). A sender checks that it yields exactly the tensors
the layout gives it, each in the shape of its box. Under pipeline parallelism every rank yields
every stage's tensors, each stage's TP shards as its tp rank holds them (`Pipeline.full_weights`
broadcasts them over the pp group, whose ranks share a tp rank). Without a layout every rank
yields full tensors (`named_weights(owned_only=False)`: experts all-gathered over EP, TP shards
over TP).

Failure: the receiver stages every bucket it receives (one extra copy of its slice of the weights,
on its device, for the duration of the sync) and copies into the engine only after every sender's
data arrived and passed `checksum.py`'s checks. A failure or a timeout (`timeout_s`, polled, so it
also holds for NCCL) raises `WeightSyncError` and the engine keeps its previous weights and version.
After a failure, close the group and join a fresh one (new port): its streams are out of step.
Replicas of one tp rank share a group, so a sender's bucket reaches all of them in one broadcast.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist

from rlloom.engines.train.base import WeightLayout
from rlloom.weight_sync.base import SyncReport, WeightSource, WeightSyncError
from rlloom.weight_sync.group import SyncGroup, SyncGroupSpec, exchange, join_sync_group, wait_all
from rlloom.weight_sync.outbox import Outbox, send_plan
from rlloom.weight_sync.reshard import TrainLayout
from rlloom.weight_sync.wire import encode_manifest

__all__ = [
    "SyncGroup",
    "SyncGroupSpec",
    "join_sync_group",
    "owner_layout",
    "send_weights",
]


def send_weights(
    group: SyncGroup | None,
    source: WeightSource,
    *,
    bucket_bytes: int,
    dtype: torch.dtype | None = None,
    checksum: bool = False,
    layout: TrainLayout | None = None,
) -> SyncReport:
    """Send the source's current weights under `source.version` to every rollout rank. Every training
    rank calls it, with the same kind of `layout` (FSDP gathers are collective); a rank that sends
    nothing passes group=None. `dtype`: None = the rollout's weight dtype. `layout`:
    - None: every rank yields every full tensor (`named_weights(owned_only=False)`, which all-gathers
      routed experts over the expert-parallel ranks and TP shards over the TP ranks) and the plan
      splits the sending between the senders;
    - `owner_layout(...)`: each rank yields only what it owns (`named_weights(owned_only=True)`, no
      EP or TP all-gather) and sends only that (what a run does under expert or tensor parallelism).
    Raises WeightSyncError when the sync failed (the rollout keeps its weights)."""
    start = time.perf_counter()
    # lazy_cast: the outbox's copy into a bucket casts what no gather moved (one pass, not two)
    weights = functools.partial(
        source.named_weights, bucket_bytes=bucket_bytes, owned_only=layout is not None, lazy_cast=True
    )
    if group is None:
        for _ in weights(dtype=dtype):
            pass
        return SyncReport(
            version=source.version, num_tensors=0, num_bytes=0, seconds=time.perf_counter() - start
        )
    deadline = time.monotonic() + group.spec.timeout_s
    links = [group.links[(group.rank, r)] for r in range(group.spec.rollout_tp)]
    io = dict(device=group.device, deadline=deadline)
    stream = None
    try:
        hello = tuple(exchange(links, [None] * len(links), root=1, what="the rollout layout", **io))
        plan = send_plan(group, layout, hello, bucket_bytes, dtype)
        dtype, routes, held = plan.dtype, plan.routes, plan.held
        manifests = [encode_manifest(source.version, dtype, route) for route in routes]
        exchange(links, manifests, root=0, what="rollout ranks to take the manifest", **io)
        outbox = Outbox(
            list(routes), links, dtype=dtype, device=group.device, checksum=checksum, deadline=deadline
        )
        # held in a name: were it collected mid-way, closing it would end the engine's iteration too
        stream = _reporting(weights(dtype=dtype), outbox.problems)
        for bucket in stream:
            for name, tensor in bucket:
                outbox.put(name, tensor, plan.shapes, held)
        outbox.finish(held)
        status = "; ".join(outbox.problems) or "ok"
        trailers = [json.dumps({"status": status, "checksums": c}).encode() for c in outbox.checksums]
        exchange(links, trailers, root=0, what="rollout ranks to take the trailer", **io)
        wait_all(
            [w for works in outbox.in_flight for w in works], deadline, "rollout ranks to take the buckets"
        )
    except (TimeoutError, RuntimeError, ValueError) as exc:
        group.broken = True
        # the other training ranks are gathering the weights with this one: go through the rest
        for _ in stream if stream is not None else weights(dtype=dtype):
            pass
        raise WeightSyncError(
            f"weight sync of version {source.version} from training rank {group.rank} failed: {exc}; "
            "the rollout keeps its previous weights. Close the sync group and join a fresh one"
        ) from exc
    if status != "ok":
        raise WeightSyncError(
            f"weight sync of version {source.version} from training rank {group.rank} failed: {status}; "
            "the rollout keeps its previous weights"
        )
    checksums = {k: v for c in outbox.checksums for k, v in c.items()}
    return SyncReport(
        version=source.version,
        num_tensors=outbox.num_pieces,
        num_bytes=outbox.num_bytes,
        seconds=time.perf_counter() - start,
        checksums=checksums,
    )


def owner_layout(layouts: Mapping[str, WeightLayout], ep_rank: int, tp_rank: int) -> TrainLayout | None:
    """The senders' layout when every training rank sends (sync rank s = training rank s) what its
    `named_weights(owned_only=True)` yields: `layouts` is the engine's `weight_layouts()` (the same on
    every rank but for the placements), `ep_rank` and `tp_rank` this rank's EP and TP ranks, gathered
    from every rank over the default process group. Collective over the training world under expert
    or tensor parallelism: every training rank calls it, once, and keeps it. None without either:
    every sender then holds every tensor (`send_weights`' default). Under pipeline parallelism
    `layouts` covers every stage (the export gives every rank every stage's tensors, TP shards of
    its own tp rank)."""
    experts = {n: w.ep_rank for n, w in layouts.items() if w.ep_rank is not None}
    tp_shards = {n: w.tp_shard for n, w in layouts.items() if w.tp_shard is not None}
    if not experts and not tp_shards:
        return None
    ranks: list[tuple[int, int]] = [(ep_rank, tp_rank)]
    if dist.is_initialized():
        ranks = [(0, 0)] * dist.get_world_size()
        dist.all_gather_object(ranks, (ep_rank, tp_rank))
    return TrainLayout.owned(
        {n: w.shape for n, w in layouts.items()},
        experts,
        [e for e, _ in ranks],
        tp_shards=tp_shards,
        sender_tp_ranks=[t for _, t in ranks],
    )


def _reporting(weights: Iterator, problems: list[str]) -> Iterator:
    """The training engine's buckets; if it raises, the error joins `problems` (the receivers must
    still hear that this sync failed) and the iteration ends."""
    try:
        yield from weights
    except Exception as exc:
        problems.append(f"the training engine raised {type(exc).__name__}: {exc}")
