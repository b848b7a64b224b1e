"""The sync group: process groups OUTSIDE both torch.distributed worlds, joining the training ranks
that send weights and the rollout ranks that receive them (`broadcast.py` moves the weights over it).

`join_sync_group` builds one process group per (sender s, rollout tp rank r), joining s and the
rollout ranks of tp rank r of every replica, from its own TCPStore (sync rank 0 hosts it at
host:port): `ProcessGroupNCCL` on GPU, `ProcessGroupGloo` on CPU, constructed directly, so neither
world's default group is touched. Byte strings and flat buffers travel by broadcast from the
group's sender (or from its first receiver); every wait polls its own deadline, so a hung peer
cannot block past it on NCCL either.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from rlloom.weight_sync.reshard import Box, Bucket, TrainLayout


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
class Link:
    pg: dist.ProcessGroup
    local_rank: int
    """This rank in the link's group: 0 is the sender, 1 the first receiver."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SendPlan:
    """What a sender works out at its first sync from the layouts on both sides (`broadcast.py`),
    kept on its `SyncGroup` while they stay the same: a large MoE has ~10^5 tensors."""

    layout: TrainLayout | None
    """The training layout the caller passed (None: every sender holds every full tensor)."""
    hello: tuple[bytes, ...]
    """What each rollout tp rank said it holds, as received."""
    bucket_bytes: int
    requested: torch.dtype | None
    """The dtype the caller asked for (None: the rollout's)."""
    dtype: torch.dtype
    """The dtype on the wire."""
    shapes: dict[str, tuple[int, ...]]
    """Full shape of every tensor the rollout loads."""
    routes: tuple[tuple[Bucket, ...], ...]
    """This sender's buckets to each rollout tp rank, in order."""
    held: dict[str, Box]
    """The tensors the training layout gives this sender, each with the box of it that it holds (what
    the training engine yields under that name: the full tensor, or e.g. a tensor-parallel shard)."""

    def fits(
        self,
        layout: TrainLayout | None,
        hello: tuple[bytes, ...],
        bucket_bytes: int,
        dtype: torch.dtype | None,
    ) -> bool:
        """Whether this plan holds for a sync with these inputs (compared by value)."""
        same_inputs = (self.bucket_bytes, self.requested, self.hello) == (bucket_bytes, dtype, hello)
        return same_inputs and self.layout == layout


@dataclass(kw_only=True, slots=True)
class SyncGroup:
    """This rank's membership of the sync group (`join_sync_group` builds it)."""

    spec: SyncGroupSpec
    rank: int
    device: torch.device
    links: dict[tuple[int, int], Link] = field(default_factory=dict)
    """(sender, tp rank) -> the process group joining them, for the pairs this rank belongs to."""
    broken: bool = False
    """A sync failed in transport (timeout, lost peer): close the group and join a fresh one."""
    plan: SendPlan | None = None
    """A sender's plan of its last sync, reused while the layouts stay the same; it lives and dies
    with the group (after a failure, a fresh group plans afresh)."""

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
            wait_all([post_broadcast(self.links[key], flag, root=0)], deadline, "the sync group's barrier")

    def close(self) -> None:
        """Leave the group (aborting what is still in flight when a sync broke it)."""
        for link in self.links.values():
            link.pg.abort() if self.broken else link.pg.shutdown()
        self.links.clear()
        self.plan = None


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
                group.links[(sender, tp_rank)] = Link(pg=pg, local_rank=members.index(rank))
    return group


# ---- transport primitives --------------------------------------------------------------------


def post_broadcast(link: Link, tensor: torch.Tensor, root: int) -> dist.Work:
    options = dist.BroadcastOptions()
    options.rootRank, options.rootTensor = root, 0
    return link.pg.broadcast([tensor.view(torch.uint8)], options)


def wait_all(works: list[dist.Work], deadline: float, what: str) -> None:
    """Wait for every work until `deadline` (time.monotonic), polling so a hung peer cannot block past it."""
    for work in works:
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}")
            time.sleep(1e-4)
        work.wait()


def exchange(
    links: list[Link],
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
    wait_all([post_broadcast(link, s, root) for link, s in zip(links, sizes)], deadline, what)
    bufs = [
        torch.frombuffer(bytearray(p), dtype=torch.uint8).to(device)
        if p is not None
        else torch.empty(int(s.item()), dtype=torch.uint8, device=device)
        for p, s in zip(mine, sizes)
    ]
    wait_all([post_broadcast(link, b, root) for link, b in zip(links, bufs)], deadline, what)
    return [bytes(b.cpu().numpy()) for b in bufs]
