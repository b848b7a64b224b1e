"""Where the workers go (a pure plan; build.py starts the groups from it).

`cluster.placement=colocated` (the default): every GPU (or CPU slot) hosts a training rank and a
rollout rank in one process; the weight sync is in place and memory is handed over by explicit
`train_group.offload()/onload()` and `rollout_group.sleep()/wake()`. Rollout replicas are
`rollout.tp` consecutive training ranks, joined by a process group of the training world.

`separate`: `cluster.num_workers` training slots, then `cluster.rollout_workers` rollout slots of
their own; the rollout ranks are not part of the training world (with `rollout.tp` > 1 they form
their own), and the weights move by the broadcast transport.

Over several nodes (`cluster.address`), the slots are cut into node groups that must share a node:
a tensor- or expert-parallel group of training ranks (the innermost, consecutive ranks) and a
rollout replica; each group is one Ray placement group packed strictly on one node, and Ray puts
the groups wherever they fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlloom.config import RunConfig


def rollout_tp(cfg: RunConfig) -> int:
    """Ranks of one rollout replica (`rollout.tp`)."""
    return cfg.rollout.tp


def replica_ranks(num_ranks: int, tp: int) -> list[list[int]]:
    """Rollout ranks of each replica: consecutive runs of `tp`. Example: (4, 2) -> [[0, 1], [2, 3]]."""
    if tp < 1 or num_ranks % tp:
        raise ValueError(f"{num_ranks} rollout ranks do not split into replicas of rollout.tp={tp}")
    return [list(range(r, r + tp)) for r in range(0, num_ranks, tp)]


@dataclass(frozen=True, slots=True)
class Placement:
    """Slots (one GPU or CPU slot each) of the training and rollout ranks. Example, separate with
    2 training and 2 rollout ranks at rollout.tp=2: train_slots=[0, 1], rollout_slots=[2, 3],
    replicas=[[0, 1]] (indices into rollout_slots)."""

    colocated: bool
    train_slots: list[int]
    """Slot of each training rank."""
    rollout_slots: list[int]
    """Slot of each rollout rank (the training rank's own slot when colocated)."""
    replicas: list[list[int]]
    """Rollout ranks of each replica."""
    node_groups: list[list[int]]
    """Slots that must share a node (a TP/EP group, a rollout replica), covering every slot once."""

    @property
    def num_slots(self) -> int:
        return len(set(self.train_slots) | set(self.rollout_slots))


def runs_of(slots: list[int], size: int) -> list[list[int]]:
    """`slots` cut into consecutive runs of `size` (the last may be shorter). Example: ([0, 1, 2], 2)
    -> [[0, 1], [2]]."""
    return [slots[i : i + size] for i in range(0, len(slots), size)]


def plan_placement(cfg: RunConfig) -> Placement:
    c = cfg.cluster
    train = list(range(c.num_workers))
    # TP is the innermost axis and EP is carved from the innermost ranks: both are consecutive ranks.
    train_group = math.lcm(cfg.parallel.tp, cfg.parallel.ep)
    replicas = replica_ranks(c.rollout_workers or c.num_workers, rollout_tp(cfg))
    if c.placement == "colocated":
        rollout = train
        groups = runs_of(train, math.lcm(train_group, rollout_tp(cfg)))
    else:
        rollout = list(range(c.num_workers, c.num_workers + c.rollout_workers))
        groups = runs_of(train, train_group) + [[rollout[j] for j in r] for r in replicas]
    return Placement(
        colocated=c.placement == "colocated",
        train_slots=train,
        rollout_slots=rollout,
        replicas=replicas,
        node_groups=groups,
    )


def missing_room(group_sizes: list[int], node_slots: list[int]) -> str | None:
    """Why nodes of `node_slots` slots each cannot hold node groups of `group_sizes` slots (each group
    on one node), or None when they may. Checks what is necessary, not a full packing: enough slots
    in all, and a node as large as the largest group. Example: ([1, 1], [1]) -> "it needs 2 slots
    (node groups of 1, 1), its alive nodes have 1 (the largest 1)"."""
    need, have = sum(group_sizes), sum(node_slots)
    largest = max(node_slots, default=0)
    if need <= have and max(group_sizes, default=0) <= largest:
        return None
    sizes = ", ".join(map(str, group_sizes))
    return (
        f"it needs {need} slots (node groups of {sizes}), its alive nodes have {have} (the largest {largest})"
    )


def train_only_placement(cfg: RunConfig) -> Placement:
    """`cluster.num_workers` training slots and no rollout ranks (`rlloom sft`)."""
    train = list(range(cfg.cluster.num_workers))
    groups = runs_of(train, math.lcm(cfg.parallel.tp, cfg.parallel.ep))
    return Placement(colocated=True, train_slots=train, rollout_slots=[], replicas=[], node_groups=groups)
