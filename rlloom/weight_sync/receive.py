"""The rollout side of the broadcast sync (broadcast.py describes the protocol): take this rank's
slices from every sender, stage them, check tiling, versions and checksums, and only then load them
into the engine."""

from __future__ import annotations

import json
import time

import torch

from rlloom.engines.rollout.base import RolloutEngine
from rlloom.weight_sync.base import SyncReport, WeightSyncError
from rlloom.weight_sync.checksum import (
    check_checksums,
    check_tiling,
    digest,
    piece_key,
    rank_layout,
    weight_dtype,
)
from rlloom.weight_sync.group import SyncGroup, exchange, post_broadcast, wait_all
from rlloom.weight_sync.reshard import Box, RankLayout, box_numel, box_shape, relative
from rlloom.weight_sync.wire import box_of, encode_layout

__all__ = ["receive_weights"]


def receive_weights(
    group: SyncGroup,
    sink: RolloutEngine,
    *,
    checksum: bool = False,
    layout: RankLayout | None = None,
    dtype: torch.dtype | None = None,
) -> SyncReport:
    """Receive this rollout rank's slices of the training weights and load them into `sink` under the
    senders' version, only once all arrived and passed the checks. `layout`/`dtype`: what the engine
    holds (default: `checksum.rank_layout(sink)`, `weight_dtype(sink)`). Raises WeightSyncError
    on failure or timeout; the sink then keeps its previous weights and version."""
    start = time.perf_counter()
    layout = layout or rank_layout(sink)
    dtype = dtype or weight_dtype(sink)
    try:
        version, tensors, report = _receive(group, layout, dtype, checksum)
    except (TimeoutError, RuntimeError) as exc:
        group.broken = not isinstance(exc, _Rejected)
        raise WeightSyncError(
            f"weight sync failed on rollout rank {group.rank - group.spec.num_senders}: {exc}; the rollout "
            f"engine keeps its previous weights (version {sink.policy_version})"
        ) from exc
    sink.update_weights(tensors, version)
    report.seconds = time.perf_counter() - start
    return report


class _Rejected(RuntimeError):
    """Everything arrived but failed the checks: the group is still in step."""


def _receive(group: SyncGroup, layout: RankLayout, dtype: torch.dtype, checksum: bool):
    deadline = time.monotonic() + group.spec.timeout_s
    links = [group.links[(s, group.tp_rank)] for s in range(group.spec.num_senders)]
    io = dict(device=group.device, deadline=deadline)
    exchange(links, [encode_layout(layout, dtype)] * len(links), root=1, what="the training ranks", **io)
    manifests = [
        json.loads(m) for m in exchange(links, [None] * len(links), root=0, what="the manifests", **io)
    ]
    buffers = [
        [
            torch.empty(
                sum(box_numel(box_of(p[1])) for p in b),
                dtype=getattr(torch, m["dtype"]),
                device=group.device,
            )
            for b in m["buckets"]
        ]
        for m in manifests
    ]
    works = [post_broadcast(link, buf, root=0) for link, bufs in zip(links, buffers) for buf in bufs]
    trailers = [
        json.loads(t) for t in exchange(links, [None] * len(links), root=0, what="the trailers", **io)
    ]
    wait_all(works, deadline, "the weight buckets")
    pieces = []  # (name, box, received view)
    for m, bufs in zip(manifests, buffers):
        for bucket, buf in zip(m["buckets"], bufs):
            offset = 0
            for name, raw in bucket:
                box = box_of(raw)
                pieces.append((name, box, buf.narrow(0, offset, box_numel(box)).view(box_shape(box))))
                offset += box_numel(box)
    targets = layout.boxes
    problems = [t["status"] for t in trailers if t["status"] != "ok"]
    versions = {m["version"] for m in manifests}
    if len(versions) != 1:
        problems.append(f"the training ranks sent different versions {sorted(versions)}")
    problems += check_tiling(targets, [(n, b) for n, b, _ in pieces])
    received = {piece_key(n, b): digest(v) for n, b, v in pieces} if checksum else {}
    if checksum:
        problems += check_checksums({k: v for t in trailers for k, v in t["checksums"].items()}, received)
    if problems:
        raise _Rejected("; ".join(problems))
    version = versions.pop()
    tensors = _assemble(targets, pieces, dtype, group.device)
    num_bytes = sum(v.numel() * v.element_size() for _, _, v in pieces)
    report = SyncReport(
        version=version, num_tensors=len(pieces), num_bytes=num_bytes, seconds=0.0, checksums=received
    )
    return version, tensors, report


def _assemble(
    targets: dict[str, Box], pieces: list, dtype: torch.dtype, device: torch.device
) -> list[tuple[str, torch.Tensor]]:
    """This rank's tensors (its box of each), in the layout's order: a view of the staged bucket
    when one piece is the whole box, else the pieces copied into a new tensor."""
    by_name: dict[str, list] = {}
    for name, box, view in pieces:
        by_name.setdefault(name, []).append((box, view))
    out = []
    for name, target in targets.items():
        parts = by_name.get(name, [])
        if len(parts) == 1 and parts[0][0] == target:
            out.append((name, parts[0][1]))
            continue
        tensor = torch.empty(box_shape(target), dtype=dtype, device=device)
        for box, view in parts:
            tensor[tuple(slice(a, b) for a, b in relative(box, target))].copy_(view)
        out.append((name, tensor))
    return out
