"""The Ray actor body: one GPU (or CPU slot) hosting a `TrainWorker`, a `RolloutWorker`, or both
(colocated placement). Imported only when cluster.mode=ray.

The actor only hosts: it joins the process groups its placement asks for, builds its workers and
calls their methods by name. What to call on which actor is decided by the groups in `ray.py`.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import ray
import torch
import torch.distributed as dist

from rlloom.config.components import RunConfig
from rlloom.devices import resolve_device, resolve_dtype
from rlloom.parallel import init_distributed
from rlloom.weight_sync.colocated import sync_colocated as sync_inplace
from rlloom.workers.rollout import RolloutWorker
from rlloom.workers.train import TrainWorker

SYNC_BUCKET_BYTES = 256 << 20


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


def tp_group_of(rank: int, replicas: list[list[int]]) -> dist.ProcessGroup | None:
    """This rank's replica group, made with `dist.new_group` over the current default world (every
    rank of that world must call this, with the same `replicas`); None for one-rank replicas."""
    if all(len(r) == 1 for r in replicas):
        return None
    mine = None
    for ranks in replicas:  # every rank creates every group, in the same order
        group = dist.new_group(ranks)
        mine = group if rank in ranks else mine
    return mine


class SlotActor:
    """One slot's process: `train` and/or `rollout`, built by `start_train` / `start_rollout`."""

    def __init__(self) -> None:
        self.train: TrainWorker | None = None
        self.rollout: RolloutWorker | None = None

    def address(self) -> tuple[str, int, int]:
        """(host ip, a free port on it, pid) for rendezvous and error reports."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port, os.getpid()

    def start_train(self, cfg: RunConfig, rank: int, world_size: int, master: tuple[str, int]) -> None:
        """Join the training world as `rank` and build the training worker."""
        torch.manual_seed(cfg.trainer.seed)
        join_world(rank, world_size, master, resolve_device(cfg).type)
        self.train = TrainWorker(cfg, rank=rank)

    def start_rollout(
        self,
        cfg: RunConfig,
        rank: int,
        replicas: list[list[int]],
        world: tuple[int, tuple[str, int]] | None,
    ) -> None:
        """Build rollout rank `rank`. Colocated (`world` None) its replica groups come from the training
        world this process already joined; separate, the rollout ranks join a world of their own
        (`world` = (size, rendezvous)) when a replica spans more than one rank."""
        torch.manual_seed(cfg.trainer.seed)
        device = resolve_device(cfg)
        if world is not None:
            join_world(rank, world[0], world[1], device.type)
        tp_group = tp_group_of(rank, replicas) if dist.is_initialized() else None
        self.rollout = RolloutWorker(
            cfg, device=device, dtype=resolve_dtype(cfg, device), rank=rank, tp_group=tp_group
        )

    def on_train(self, method: str, *args: Any) -> Any:
        return getattr(self.train, method)(*args)

    def on_rollout(self, method: str, *args: Any) -> Any:
        return getattr(self.rollout, method)(*args)

    def versions(self) -> tuple[int | None, int | None]:
        """(training version, rollout version) of the workers this slot hosts."""
        return (
            self.train.version if self.train is not None else None,
            self.rollout.version if self.rollout is not None else None,
        )

    def sync_inplace(self) -> dict[str, float]:
        """Colocated: this process's training weights into its rollout rank, in place."""
        assert self.train is not None and self.rollout is not None
        return sync_inplace(
            self.train, self.rollout, bucket_bytes=SYNC_BUCKET_BYTES, dtype=self.train.dtype
        ).metrics()

    def export_weights(self, publish: bool) -> tuple[Any, int, int] | None:
        """Separate placement: gather the training weights (every rank must take part) and, on the
        publishing rank, put them in the object store once for every rollout rank to fetch.
        Returns (ref of (version, buckets), bytes, tensors) there, None elsewhere."""
        assert self.train is not None
        buckets = [
            [(name, t.detach().cpu()) for name, t in bucket]
            for bucket in self.train.named_weights(bucket_bytes=SYNC_BUCKET_BYTES, dtype=self.train.dtype)
        ]
        if not publish:
            return None
        num_bytes = sum(t.numel() * t.element_size() for b in buckets for _, t in b)
        return ray.put((self.train.version, buckets)), num_bytes, sum(len(b) for b in buckets)

    def import_weights(self, payload: tuple[int, list[list[tuple[str, torch.Tensor]]]]) -> float:
        """Separate placement: copy the published buckets into this rollout rank; returns seconds."""
        assert self.rollout is not None
        start = time.perf_counter()
        version, buckets = payload
        for bucket in buckets:
            self.rollout.update_weights(bucket, version)
        return time.perf_counter() - start
