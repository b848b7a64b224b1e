"""The factory the controller builds its groups with: one process for cluster.mode=inline (local.py),
Ray actors placed as placement.py plans (ray.py; Ray imported only then) for cluster.mode=ray.
`rlloom sft` builds the training group alone (`build_train_group`): no rollout, no weight sync."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

from rlloom.cluster.base import CriticGroup, RolloutGroup, TrainGroup, WeightSync
from rlloom.cluster.placement import plan_placement, train_only_placement
from rlloom.config import RunConfig
from rlloom.heap import freeze_heap, thaw_heap


@dataclass(kw_only=True, slots=True)
class Groups:
    """What the controller drives: the two groups and the weight sync between them, and PPO's critic
    (on the training ranks) when the estimator needs one."""

    train: TrainGroup
    rollout: RolloutGroup
    sync: WeightSync
    critic: CriticGroup | None = None

    def freeze_heap(self) -> None:
        """`rlloom.heap.freeze_heap` here and in every worker process (the run loop: after the first step)."""
        freeze_heap()
        self.train.freeze_heap().result()
        self.rollout.freeze_heap().result()

    def close(self) -> None:
        self.rollout.close()
        self.train.close()
        thaw_heap()  # this process may build more groups: the closed ones must be collectable


def cluster_session(cfg: RunConfig) -> AbstractContextManager[None]:
    """What a whole run (every restart of it) shares: with cluster.mode=ray, Ray, started (or joined)
    once and shut down at the end when the session started it (`ray_slots.ray_session`); nothing inline."""
    if cfg.cluster.mode != "ray":
        return nullcontext()
    from rlloom.cluster.ray_slots import ray_session

    return ray_session(cfg, plan_placement(cfg).num_slots)


def build_groups(cfg: RunConfig) -> Groups:
    """One process for cluster.mode=inline; Ray actors (Ray imported only then) for cluster.mode=ray."""
    if cfg.cluster.mode == "ray":
        from rlloom.cluster.ray import build_ray_groups

        train, rollout, sync, critic = build_ray_groups(cfg, plan_placement(cfg))
    else:
        from rlloom.cluster.local import build_local_groups

        train, rollout, sync, critic = build_local_groups(cfg)
    return Groups(train=train, rollout=rollout, sync=sync, critic=critic)


def build_train_group(cfg: RunConfig) -> TrainGroup:
    """The training ranks alone (supervised fine-tuning), in the layout of the `parallel` section:
    one process for cluster.mode=inline, `cluster.num_workers` Ray actors for cluster.mode=ray."""
    if cfg.cluster.mode == "ray":
        from rlloom.cluster.ray import build_ray_train_group

        return build_ray_train_group(cfg, train_only_placement(cfg))
    from rlloom.cluster.local import LocalTrainGroup
    from rlloom.workers.train import TrainWorker

    return LocalTrainGroup(TrainWorker(cfg))
