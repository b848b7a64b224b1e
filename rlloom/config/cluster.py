"""The `cluster` section: inline or Ray, workers, colocated or separate placement, device."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlloom.config.checks import check, check_finite


@dataclass(kw_only=True, slots=True)
class ClusterConfig:
    mode: Literal["inline", "ray"] = "inline"
    """`inline`: everything in this process; `ray`: one actor per GPU (or CPU slot)."""
    num_workers: int = 1
    """Training ranks (data parallel). With placement=colocated each also hosts a rollout rank on
    the same device."""
    placement: Literal["colocated", "separate"] = "colocated"
    """`colocated`: training and rollout share the same GPUs and hand memory over (offload/onload,
    sleep/wake); `separate`: `rollout_workers` GPUs (or CPU slots) for rollout apart from the
    `num_workers` training ones, with the weights broadcast after each step (needs cluster.mode=ray)."""
    rollout_workers: int = 0
    """GPUs (or CPU slots) of the rollout pool with placement=separate (a multiple of rollout.tp);
    0 with colocated, where the rollout runs on the training GPUs."""
    address: str = ""
    """Ray address: empty starts a local Ray; `auto` or host:port joins a cluster, whose nodes the
    actors spread over (a TP/EP group and a rollout replica each on one node; RUN_DIR/actors.json
    says where each runs)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device for engines: auto picks cuda when available."""
    timeout_s: float = 600.0
    """Longest wait for any worker call before the run is stopped as hung."""

    def __post_init__(self) -> None:
        check_finite(self, "cluster")
        check(self.num_workers >= 1, "cluster.num_workers", self.num_workers, "must be >= 1", "use 1")
        check(self.timeout_s > 0, "cluster.timeout_s", self.timeout_s, "must be > 0", "e.g. 600")
        check(
            self.mode == "ray" or self.num_workers == 1,
            "cluster.num_workers",
            self.num_workers,
            "more than one worker needs cluster.mode=ray",
            "set cluster.mode=ray or cluster.num_workers=1",
        )
        if self.placement == "separate":
            check(
                self.rollout_workers >= 1,
                "cluster.rollout_workers",
                self.rollout_workers,
                "cluster.placement=separate needs at least one rollout GPU (or CPU slot)",
                "set cluster.rollout_workers=1 or more, or cluster.placement=colocated",
            )
            check(
                self.mode == "ray",
                "cluster.mode",
                self.mode,
                "cluster.placement=separate runs the rollout in its own processes, which needs Ray",
                "set cluster.mode=ray, or cluster.placement=colocated",
            )
        else:
            check(
                self.rollout_workers == 0,
                "cluster.rollout_workers",
                self.rollout_workers,
                "with cluster.placement=colocated the rollout runs on the training GPUs",
                "set cluster.rollout_workers=0, or cluster.placement=separate for a rollout pool of its own",
            )
