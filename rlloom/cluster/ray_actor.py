"""The Ray actor body: one GPU (or CPU slot) hosting a `TrainWorker` (with PPO's critic also a
`CriticWorker`), a `RolloutWorker`, or both (colocated placement). Imported only when cluster.mode=ray.

The actor only hosts: it joins the process groups its placement asks for, builds its workers and
calls their methods by name. What to call on which actor is decided by the groups in `ray.py`.
"""

from __future__ import annotations

import functools
import os
from datetime import timedelta
from typing import Any

import ray
import torch
import torch.distributed as dist

from rlloom.cluster.local import sync_in_place
from rlloom.config import RunConfig
from rlloom.determinism import enable_determinism
from rlloom.devices import resolve_device, resolve_dtype
from rlloom.heap import freeze_heap
from rlloom.observability.log import init_logger
from rlloom.parallel import init_distributed
from rlloom.parallel.distributed import free_port
from rlloom.weight_sync.base import checksum_enabled
from rlloom.weight_sync.broadcast import (
    SyncGroup,
    SyncGroupSpec,
    join_sync_group,
    owner_layout,
    send_weights,
)
from rlloom.weight_sync.receive import receive_weights
from rlloom.weight_sync.reshard import TrainLayout
from rlloom.workers.critic import CriticWorker
from rlloom.workers.rollout import RolloutWorker
from rlloom.workers.train import TrainWorker


def join_world(rank: int, world_size: int, master: tuple[str, int], device_type: str) -> None:
    """Join the default process group of `world_size` ranks whose rendezvous is `master`."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK="0",  # Ray gives each GPU actor its own CUDA_VISIBLE_DEVICES
        MASTER_ADDR=master[0],
        MASTER_PORT=str(master[1]),
    )
    init_distributed(device_type)


def replica_groups(
    rank: int, replicas: list[list[int]], timeout_s: float
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """This rank's replica groups, made with `dist.new_group` over the current default world (every
    rank of that world must call this, with the same `replicas`): the tensor-parallel group (the
    world's backend) and a gloo group of the same ranks for the stream's per-step commands (a small
    host tensor each step, never a device sync), whose collectives fail after `timeout_s`. (None,
    None) for one-rank replicas."""
    if all(len(r) == 1 for r in replicas):
        return None, None
    tp = control = None
    for ranks in replicas:  # every rank creates every group, in the same order
        group = dist.new_group(ranks)
        gloo = dist.new_group(ranks, backend="gloo", timeout=timedelta(seconds=timeout_s))
        if rank in ranks:
            tp, control = group, gloo
    return tp, control


class SlotActor:
    """One slot's process: `train` and/or `rollout`, built by `start_train` / `start_rollout`."""

    def __init__(self, cfg: RunConfig) -> None:
        init_logger()  # its start-up phases (first generated token) reach the driver's output
        enable_determinism(cfg.trainer.deterministic)
        self.cfg = cfg
        self.train: TrainWorker | None = None
        self.critic: CriticWorker | None = None
        self.rollout: RolloutWorker | None = None
        self.sync_group: SyncGroup | None = None
        """Separate placement: this rank's part of the broadcast sync group (every training rank sends)."""

    def address(self) -> tuple[str, int, int]:
        """(host ip, a free port on it, pid) for rendezvous and error reports."""
        return ray.util.get_node_ip_address(), free_port(), os.getpid()

    def start_train(self, rank: int, world_size: int, master: tuple[str, int]) -> None:
        """Join the training world as `rank` and build the training worker (and the critic's rank)."""
        torch.manual_seed(self.cfg.trainer.seed)
        join_world(rank, world_size, master, resolve_device(self.cfg).type)
        self.train = TrainWorker(self.cfg, rank=rank)
        if self.cfg.algorithm.uses_critic:
            self.critic = CriticWorker(self.cfg, rank=rank)

    def start_rollout(
        self,
        rank: int,
        replicas: list[list[int]],
        world: tuple[int, tuple[str, int]] | None,
    ) -> None:
        """Build rollout rank `rank`. Colocated (`world` None) its replica groups come from the training
        world this process already joined; separate, the rollout ranks join a world of their own
        (`world` = (size, rendezvous)) when a replica spans more than one rank."""
        torch.manual_seed(self.cfg.trainer.seed)
        device = resolve_device(self.cfg)
        if world is not None:
            join_world(rank, world[0], world[1], device.type)
        tp_group, control_group = (
            replica_groups(rank, replicas, self.cfg.cluster.timeout_s)
            if dist.is_initialized()
            else (None, None)
        )
        self.rollout = RolloutWorker(
            self.cfg,
            device=device,
            dtype=resolve_dtype(self.cfg, device),
            rank=rank,
            tp_group=tp_group,
            control_group=control_group,
        )

    def on_train(self, method: str, *args: Any) -> Any:
        return getattr(self.train, method)(*args)

    def on_critic(self, method: str, *args: Any) -> Any:
        return getattr(self.critic, method)(*args)

    def on_rollout(self, method: str, *args: Any) -> Any:
        return getattr(self.rollout, method)(*args)

    def freeze_heap(self) -> None:
        freeze_heap()

    def versions(self) -> tuple[int | None, int | None]:
        """(training version, rollout version) of the workers this slot hosts."""
        return (
            self.train.version if self.train is not None else None,
            self.rollout.version if self.rollout is not None else None,
        )

    def sync_inplace(self) -> dict[str, float]:
        """Colocated: this process's training weights into its rollout rank, in place."""
        assert self.train is not None and self.rollout is not None
        return sync_in_place(self.cfg, self.train, self.rollout)

    def join_sync(self, spec: SyncGroupSpec, rank: int) -> None:
        """Separate placement: join the broadcast sync group as sync rank `rank` (collective over the
        sending training ranks and every rollout rank)."""
        device = self.train.device if self.train is not None else resolve_device(self.cfg)
        self.sync_group = join_sync_group(spec, rank, device)

    def send_weights(self) -> dict[str, float]:
        """Separate placement, every training rank: gather the weights over FSDP (collective) and send
        what the plan gives this rank of what it owns (its routed experts, its TP shards, a share of
        the rest)."""
        assert self.train is not None
        report = send_weights(
            self.sync_group,
            self.train,
            bucket_bytes=self.cfg.sync.bucket_mb << 20,
            checksum=checksum_enabled(self.cfg.sync.checksum, self.train.device),
            layout=self.sync_layout,
        )
        return report.metrics()

    @functools.cached_property
    def sync_layout(self) -> TrainLayout | None:
        """Separate placement, training ranks: what each sender owns (`owner_layout`), built at the
        first sync (collective over the training world)."""
        assert self.train is not None
        return owner_layout(self.train.weight_layouts(), self.train.ep_rank, self.train.tp_rank)

    def receive_weights(self) -> int:
        """Separate placement, every rollout rank: take this rank's slices and load them; returns the
        version now held (unchanged when the sync failed, which raises)."""
        assert self.rollout is not None and self.sync_group is not None
        checksum = checksum_enabled(self.cfg.sync.checksum, resolve_device(self.cfg))
        report = receive_weights(self.sync_group, self.rollout.engine, checksum=checksum)
        self.rollout.version = report.version
        return report.version
