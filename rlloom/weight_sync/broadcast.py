"""Weight sync between separate GPU pools: the training ranks that send and the rollout ranks that
receive join a sync group OUTSIDE both torch.distributed worlds (each side keeps its own world).

API (the workers call exactly these):

    spec = SyncGroupSpec(host=..., port=..., num_senders=S, num_receivers=R, rollout_tp=tp,
                         timeout_s=cfg.sync.timeout_s)
    group = join_sync_group(spec, rank, device)   # every member, at start-up; collective
        # ranks 0..S-1: the training ranks that send; S..S+R-1: the rollout ranks, rollout rank i
        # being tp rank i % tp of replica i // tp
    # each sync, on every training rank (non-senders pass group=None: FSDP gathers are collective):
    report = send_weights(group, train_engine, bucket_bytes=cfg.sync.bucket_mb << 20,
                          dtype=None, checksum=checksum_enabled(cfg.sync.checksum, device),
                          layout=None)            # -> SyncReport
    # each sync, on every rollout rank, at the same time:
    report = receive_weights(group, rollout_engine, checksum=...)   # -> SyncReport
    group.close()

How: `join_sync_group` builds one process group per (sender s, rollout tp rank r), joining s and
the rollout ranks of tp rank r of every replica, from its own TCPStore (rank 0 hosts it at
host:port): `ProcessGroupNCCL` on GPU, `ProcessGroupGloo` on CPU, constructed directly, so neither
world's default group is touched. Each sync, on each of those groups:
1. the first receiver of each tp rank broadcasts what that rank holds (names, full shapes, its
   slice of each, dtype: `checksum.rank_layout`) and every sender plans with `reshard.plan_reshard` (training layout: `layout`, default every sender
   holds every full tensor, as today's engines yield them) who sends which slice;
2. the sender broadcasts a manifest: version, dtype, its buckets and their pieces (name, box);
3. then each bucket as one flat buffer (at most `bucket_bytes`), filled as the training engine
   yields its tensors, at most 3 in flight per group; a rollout TP rank receives only its slices;
4. then a trailer: "ok" or what went wrong on the sender, and the content checksums.

Failure: the receiver stages every bucket it receives (one extra copy of its slice of the weights,
on its device, for the duration of the sync) and copies into the engine only after every sender's
data arrived and passed `checksum.py`'s checks. A failure or a timeout (`timeout_s`, polled, so it
also holds for NCCL) raises `WeightSyncError` and the engine keeps its previous weights and version.
After a failure, close the group and join a fresh one (new port): its streams are out of step.
Replicas of one tp rank share a group, so a sender's bucket reaches all of them in one broadcast.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from rlloom.weight_sync.base import SyncReport, WeightSink, WeightSource, WeightSyncError
from rlloom.weight_sync.checksum import (
    check_checksums,
    check_tiling,
    digest,
    piece_key,
    rank_layout,
    weight_dtype,
)
from rlloom.weight_sync.reshard import (
    Box,
    Bucket,
    RankLayout,
    RolloutLayout,
    TrainLayout,
    box_numel,
    box_shape,
    plan_reshard,
    relative,
)

_MAX_IN_FLIGHT = 3


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncGroupSpec:
    """Where and how big the sync group is. Example: `SyncGroupSpec(host="10.0.0.1", port=29600,
    num_senders=1, num_receivers=2, rollout_tp=2)`."""

    host: str
    """Address of the sync group's rank 0 (the first sender), which hosts its TCPStore."""
    port: int
    """A free port on `host`, different from both worlds' (MASTER_PORT)."""
    num_senders: int
    """Training ranks that send (sync ranks 0..num_senders-1)."""
    num_receivers: int
    """Rollout ranks (sync ranks num_senders..): replicas x rollout_tp."""
    rollout_tp: int = 1
    """Ranks of one rollout replica (`rollout.tp`)."""
    timeout_s: float = 300.0
    """Longest a join or a sync may take (`sync.timeout_s`)."""

    @property
    def world_size(self) -> int:
        return self.num_senders + self.num_receivers

    def members(self, sender: int, tp_rank: int) -> list[int]:
        """Sync ranks of the group (sender, tp rank): the sender first, then its receivers."""
        receivers = range(self.num_receivers)
        return [sender] + [self.num_senders + i for i in receivers if i % self.rollout_tp == tp_rank]


@dataclass(kw_only=True, slots=True)
class _Link:
    pg: dist.ProcessGroup
    local_rank: int
    """This rank in the link's group: 0 is the sender, 1 the first receiver."""


@dataclass(kw_only=True, slots=True)
class SyncGroup:
    """This rank's membership of the sync group (`join_sync_group` builds it)."""

    spec: SyncGroupSpec
    rank: int
    device: torch.device
    links: dict[tuple[int, int], _Link] = field(default_factory=dict)
    """(sender, tp rank) -> the process group joining them, for the pairs this rank belongs to."""
    broken: bool = False
    """A sync failed in transport (timeout, lost peer): close the group and join a fresh one."""

    @property
    def is_sender(self) -> bool:
        return self.rank < self.spec.num_senders

    @property
    def tp_rank(self) -> int:
        """The rollout tp rank of this receiver."""
        return (self.rank - self.spec.num_senders) % self.spec.rollout_tp

    def barrier(self) -> None:
        """Wait until every member got here (a one-byte broadcast on each of this rank's groups, in
        the global order); benchmarks use it to start a timed sync together."""
        deadline = time.monotonic() + self.spec.timeout_s
        for key in sorted(self.links):
            flag = torch.zeros(1, dtype=torch.uint8, device=self.device)
            _wait([_broadcast(self.links[key], flag, root=0)], deadline, "the sync group's barrier")

    def close(self) -> None:
        """Leave the group (aborting what is still in flight when a sync broke it)."""
        for link in self.links.values():
            link.pg.abort() if self.broken else link.pg.shutdown()
        self.links.clear()


def _new_pg(store: dist.Store, rank: int, size: int, device: torch.device, timeout: timedelta, name: str):
    if device.type == "cuda":
        torch.cuda.set_device(device)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        options.group_name = name
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def join_sync_group(spec: SyncGroupSpec, rank: int, device: torch.device) -> SyncGroup:
    """Join the sync group as sync rank `rank` (collective: every member calls it at the same time).
    The groups are built in one global order, so no two members wait on each other."""
    if not 0 <= rank < spec.world_size:
        raise ValueError(f"sync rank {rank} is invalid: the sync group has {spec.world_size} ranks.")
    if spec.num_receivers % spec.rollout_tp:
        raise ValueError(
            f"rollout ranks={spec.num_receivers} is invalid: must be a multiple of rollout.tp={spec.rollout_tp}. "
            "Fix: give every rollout replica rollout.tp ranks."
        )
    # Joining waits for the slowest member to start (at least 5 minutes); syncs keep to timeout_s
    # by polling their own deadline.
    timeout = timedelta(seconds=max(spec.timeout_s, 300.0))
    store = dist.TCPStore(spec.host, spec.port, spec.world_size, is_master=rank == 0, timeout=timeout)
    group = SyncGroup(spec=spec, rank=rank, device=device)
    for sender in range(spec.num_senders):
        for tp_rank in range(spec.rollout_tp):
            members = spec.members(sender, tp_rank)
            if rank in members:
                name = f"rlloom_sync_{sender}_{tp_rank}"
                pg = _new_pg(
                    dist.PrefixStore(name, store), members.index(rank), len(members), device, timeout, name
                )
                group.links[(sender, tp_rank)] = _Link(pg=pg, local_rank=members.index(rank))
    return group


# ---- transport primitives --------------------------------------------------------------------


def _broadcast(link: _Link, tensor: torch.Tensor, root: int) -> dist.Work:
    options = dist.BroadcastOptions()
    options.rootRank, options.rootTensor = root, 0
    return link.pg.broadcast([tensor.view(torch.uint8)], options)


def _wait(works: list[dist.Work], deadline: float, what: str) -> None:
    """Wait for every work until `deadline` (time.monotonic), polling so a hung peer cannot block past it."""
    for work in works:
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}")
            time.sleep(1e-4)
        work.wait()


def _exchange(
    links: list[_Link],
    payloads: list[bytes | None],
    *,
    root: int,
    device: torch.device,
    deadline: float,
    what: str,
) -> list[bytes]:
    """Broadcast a byte string from local rank `root` on every link (size first, then bytes)."""
    mine = [p if link.local_rank == root else None for link, p in zip(links, payloads, strict=True)]
    sizes = [torch.tensor([len(p) if p is not None else 0], dtype=torch.int64, device=device) for p in mine]
    _wait([_broadcast(link, s, root) for link, s in zip(links, sizes)], deadline, what)
    bufs = [
        torch.frombuffer(bytearray(p), dtype=torch.uint8).to(device)
        if p is not None
        else torch.empty(int(s.item()), dtype=torch.uint8, device=device)
        for p, s in zip(mine, sizes)
    ]
    _wait([_broadcast(link, b, root) for link, b in zip(links, bufs)], deadline, what)
    return [bytes(b.cpu().numpy()) for b in bufs]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _encode_layout(layout: RankLayout, dtype: torch.dtype) -> bytes:
    boxes = {n: [list(r) for r in b] for n, b in layout.boxes.items()}
    return json.dumps({"shapes": layout.shapes, "boxes": boxes, "dtype": _dtype_name(dtype)}).encode()


def _decode_layout(data: bytes) -> tuple[RankLayout, torch.dtype]:
    raw = json.loads(data)
    shapes = {n: tuple(s) for n, s in raw["shapes"].items()}
    layout = RankLayout(shapes=shapes, boxes={n: _box_of(b) for n, b in raw["boxes"].items()})
    return layout, getattr(torch, raw["dtype"])


def _box_of(raw: list[list[int]]) -> Box:
    return tuple((a, b) for a, b in raw)


# ---- sending ---------------------------------------------------------------------------------


class _Outbox:
    """The sender's buckets: filled as tensors arrive, each broadcast once complete (in plan order)."""

    def __init__(
        self,
        routes: list[tuple[Bucket, ...]],
        links: list[_Link],
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
        self.problems: list[str] = []
        self.num_bytes = self.num_pieces = 0

    def _buffer(self, r: int, b: int) -> torch.Tensor:
        if (r, b) not in self.buffers:
            numel = self.routes[r][b].numel
            self.buffers[(r, b)] = torch.zeros(numel, dtype=self.dtype, device=self.device)
        return self.buffers[(r, b)]

    def put(self, name: str, tensor: torch.Tensor, shapes: dict[str, tuple[int, ...]]) -> None:
        if name in self.seen:
            self.problems.append(f"the training engine yielded {name!r} twice")
            return
        self.seen.add(name)
        if name not in shapes:
            self.problems.append(
                f"the training engine yielded {name!r}, which the rollout model does not have"
            )
            return
        if tuple(tensor.shape) != tuple(shapes[name]):
            self.problems.append(
                f"{name!r} has shape {list(tensor.shape)} in training, {list(shapes[name])} in the rollout"
            )
            return
        for r, b, offset, box in self.slots.get(name, []):
            view = self._buffer(r, b).narrow(0, offset, box_numel(box)).view(box_shape(box))
            view.copy_(tensor[tuple(slice(start, stop) for start, stop in box)])
            if self.checksum:
                self.checksums[r][piece_key(name, box)] = digest(view)
            self.remaining[(r, b)] -= 1
            self._flush(r)

    def _flush(self, r: int) -> None:
        route = self.routes[r]
        while self.next[r] < len(route) and self.remaining[(r, self.next[r])] == 0:
            buf = self._buffer(r, self.next[r])
            self.in_flight[r].append(_broadcast(self.links[r], buf, root=0))
            self.num_bytes += buf.numel() * buf.element_size()
            self.num_pieces += len(route[self.next[r]].pieces)
            del self.buffers[(r, self.next[r])]  # the work keeps it alive until sent
            self.next[r] += 1
            if len(self.in_flight[r]) > _MAX_IN_FLIGHT:
                _wait([self.in_flight[r].pop(0)], self.deadline, "a rollout rank to take a bucket")

    def finish(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """Send what is left (buckets with tensors the engine never yielded go out as zeros, so the
        receivers' streams stay in step; the trailer says the sync failed)."""
        missing = sorted(set(shapes) - self.seen)
        if missing:
            self.problems.append(f"the training engine did not yield {len(missing)} tensors: {missing[:5]}")
        for key in self.remaining:
            self.remaining[key] = 0
        for r in range(len(self.routes)):
            self._flush(r)


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
    rank calls it (each iterates `source.named_weights`: FSDP gathers are collective); a rank that
    sends nothing passes group=None. `dtype`: None = the rollout's weight dtype. `layout`: what each
    sender holds (default: every sender holds every full tensor; the plan then splits the sending
    between them). Raises WeightSyncError when the sync failed (the rollout keeps its weights)."""
    start = time.perf_counter()
    if group is None:
        for _ in source.named_weights(bucket_bytes=bucket_bytes, dtype=dtype):
            pass
        return SyncReport(
            version=source.version, num_tensors=0, num_bytes=0, seconds=time.perf_counter() - start
        )
    deadline = time.monotonic() + group.spec.timeout_s
    links = [group.links[(group.rank, r)] for r in range(group.spec.rollout_tp)]
    io = dict(device=group.device, deadline=deadline)
    try:
        hello = [
            _decode_layout(h)
            for h in _exchange(links, [None] * len(links), root=1, what="the rollout layout", **io)
        ]
        rollout, rollout_dtype = RolloutLayout(ranks=tuple(rank for rank, _ in hello)), hello[0][1]
        dtype = dtype or rollout_dtype
        train = layout or TrainLayout.replicated(rollout.shapes, group.spec.num_senders)
        plan = plan_reshard(train, rollout, bucket_numel=max(1, bucket_bytes // dtype.itemsize))
        routes = [plan.route(group.rank, r) for r in range(len(links))]
        manifests = [_manifest(source.version, dtype, route) for route in routes]
        _exchange(links, manifests, root=0, what="rollout ranks to take the manifest", **io)
        outbox = _Outbox(
            routes, links, dtype=dtype, device=group.device, checksum=checksum, deadline=deadline
        )
        try:
            for bucket in source.named_weights(bucket_bytes=bucket_bytes, dtype=dtype):
                for name, tensor in bucket:
                    outbox.put(name, tensor, rollout.shapes)
        except Exception as exc:  # the receivers must still hear that this sync failed
            outbox.problems.append(f"the training engine raised {type(exc).__name__}: {exc}")
        outbox.finish(rollout.shapes)
        status = "; ".join(outbox.problems) or "ok"
        trailers = [json.dumps({"status": status, "checksums": c}).encode() for c in outbox.checksums]
        _exchange(links, trailers, root=0, what="rollout ranks to take the trailer", **io)
        _wait([w for works in outbox.in_flight for w in works], deadline, "rollout ranks to take the buckets")
    except (TimeoutError, RuntimeError) as exc:
        group.broken = True
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


def _manifest(version: int, dtype: torch.dtype, route: tuple[Bucket, ...]) -> bytes:
    buckets = [[[p.name, [list(r) for r in p.box]] for p in b.pieces] for b in route]
    return json.dumps({"version": version, "dtype": _dtype_name(dtype), "buckets": buckets}).encode()


# ---- receiving -------------------------------------------------------------------------------


def receive_weights(
    group: SyncGroup,
    sink: WeightSink,
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
            f"engine keeps its previous weights (version {getattr(sink, 'policy_version', '?')})"
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
    _exchange(links, [_encode_layout(layout, dtype)] * len(links), root=1, what="the training ranks", **io)
    manifests = [
        json.loads(m) for m in _exchange(links, [None] * len(links), root=0, what="the manifests", **io)
    ]
    buffers = [
        [
            torch.empty(
                sum(box_numel(_box_of(p[1])) for p in b),
                dtype=getattr(torch, m["dtype"]),
                device=group.device,
            )
            for b in m["buckets"]
        ]
        for m in manifests
    ]
    works = [_broadcast(link, buf, root=0) for link, bufs in zip(links, buffers) for buf in bufs]
    trailers = [
        json.loads(t) for t in _exchange(links, [None] * len(links), root=0, what="the trailers", **io)
    ]
    _wait(works, deadline, "the weight buckets")
    pieces = []  # (name, box, received view)
    for m, bufs in zip(manifests, buffers):
        for bucket, buf in zip(m["buckets"], bufs):
            offset = 0
            for name, raw in bucket:
                box = _box_of(raw)
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
