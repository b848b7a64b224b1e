"""The run's Ray actors, one per slot, placed node group by node group (`Placement.node_groups`: a
TP/EP group or a rollout replica is one placement group packed strictly on one node), and the
waiting that turns their failures into `SlotFailure`. Imported only when cluster.mode=ray.

Every actor is logged at start-up with its role, rank, node, pid and device, and the list is
written to `RUN_DIR/actors.json` (rewritten whenever an actor is replaced):
`[{"role": "train", "rank": 0, "node_ip": "10.0.0.2", "node_id": "8f...", "pid": 4242, "device": "cuda:3"}, ...]`
(`node_id` tells apart two nodes on one machine, which share an ip).

Before actors are placed (at the start, at a restart, for a replacement) and while they wait for
their place, a cluster that lost a node must still have room for the layout on its alive nodes;
when it does not, `NoRoom` stops the run at once instead of waiting `cluster.timeout_s` for a slot.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlloom.cluster.base import NoRoom, WorkerFailure
from rlloom.cluster.placement import Placement, missing_room
from rlloom.cluster.ray_actor import SlotActor
from rlloom.config import RunConfig
from rlloom.determinism import determinism_env
from rlloom.run_files import write_text

log = logging.getLogger(__name__)
ACTOR_ERRORS = (RayActorError, RayTaskError, GetTimeoutError)
ACTORS_FILE = "actors.json"


class SlotFailure(WorkerFailure):
    """A worker call failed; `slots` are the slots whose actor died, raised or hung. `lost`: the
    actors died or hung (to be replaced), not a method that raised in a live actor."""

    def __init__(self, message: str, slots: list[int], *, lost: bool = True) -> None:
        super().__init__(message)
        self.slots, self.lost = slots, lost


def slot_roles(placement: Placement, slot: int, *, critic: bool) -> list[tuple[str, int]]:
    """(role, rank) of each worker slot `slot` hosts. Example, colocated slot 1 with a critic:
    [("train", 1), ("critic", 1), ("rollout", 1)]."""
    roles = []
    if slot in placement.train_slots:
        rank = placement.train_slots.index(slot)
        roles += [("train", rank)] + ([("critic", rank)] if critic else [])
    if slot in placement.rollout_slots:
        roles.append(("rollout", placement.rollout_slots.index(slot)))
    return roles


def uses_gpu(cfg: RunConfig) -> bool:
    """The actors take a GPU each (cluster.device cuda, or auto with CUDA present)."""
    return cfg.cluster.device == "cuda" or (cfg.cluster.device == "auto" and torch.cuda.is_available())


def start_ray(cfg: RunConfig, num_slots: int) -> bool:
    """Start a local Ray instance, or join `cluster.address`, unless this process is connected
    already; True when this call connected (its caller shuts Ray down)."""
    if ray.is_initialized():
        return False
    local_cpu = not (uses_gpu(cfg) or cfg.cluster.address)
    phase = time.perf_counter()
    ray.init(
        address=cfg.cluster.address or None,
        # A local CPU cluster gets a slot per actor even on a machine with fewer cores.
        num_cpus=max(os.cpu_count() or 1, num_slots) if local_cpu else None,
        include_dashboard=False,
        log_to_driver=True,
    )
    where = f"joined {cfg.cluster.address}" if cfg.cluster.address else "a local instance"
    log.info("start-up: Ray %.1f s (%s)", time.perf_counter() - phase, where)
    return True


@contextmanager
def ray_session(cfg: RunConfig, num_slots: int) -> Iterator[None]:
    """Ray for a whole run, kept across its training restarts: a restart replaces the actors, not the
    local Ray instance, whose start costs seconds (on a busy machine more than the 30 s Ray gives its
    raylet to register, which ended a restarted run with Ray's traceback). Shut down at the end when
    this session started it."""
    started = start_ray(cfg, num_slots)
    try:
        yield
    finally:
        if started:
            ray.shutdown()


class Actors:
    """The run's actors, one per slot; `replace(slot)` starts a fresh one in the same place."""

    def __init__(self, cfg: RunConfig, placement: Placement) -> None:
        self.timeout_s = cfg.cluster.timeout_s
        self.run_dir = Path(cfg.trainer.run_dir)
        self.use_gpu = uses_gpu(cfg)
        self._owns_ray = start_ray(cfg, placement.num_slots)  # False in a run: `ray_session` holds it
        self.node_groups = placement.node_groups
        self.labels = [_label(placement, s) for s in range(placement.num_slots)]
        self.roles = [
            slot_roles(placement, s, critic=cfg.algorithm.uses_critic) for s in range(placement.num_slots)
        ]
        self.hosts: list[str] = []
        self.slots: list[Any] = []
        try:
            self._place(cfg, placement)
        except BaseException:
            self.close()
            raise

    def _place(self, cfg: RunConfig, placement: Placement) -> None:
        bundle = {"GPU": 1, "CPU": 1} if self.use_gpu else {"CPU": 1}
        self.check_room()
        self.pgs = [placement_group([bundle] * len(g), strategy="STRICT_PACK") for g in placement.node_groups]
        self.bundles = {s: (pg, i) for pg, g in zip(self.pgs, placement.node_groups) for i, s in enumerate(g)}
        self.wait([pg.ready() for pg in self.pgs], "placement group", [-1] * len(self.pgs), watch_room=True)
        # The actors see the driver's RLLOOM_/NCCL_/TORCH_ settings, also in a cluster joined by address.
        env = {k: v for k, v in os.environ.items() if k.startswith(("RLLOOM_", "NCCL_", "TORCH_"))}
        env.update(determinism_env(cfg.trainer.deterministic))  # set before the actor's CUDA starts
        self.cfg = cfg
        self.actor_cls = ray.remote(
            num_cpus=1, num_gpus=1 if self.use_gpu else 0, runtime_env={"env_vars": env}
        )(SlotActor)
        n = placement.num_slots
        self.slots = [self._new_actor(s) for s in range(n)]
        self.hosts, self.addresses, self.records = [""] * n, [("", 0)] * n, [{}] * n
        self._describe(list(range(n)))

    def _new_actor(self, slot: int) -> Any:
        pg, index = self.bundles[slot]
        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index)
        return self.actor_cls.options(scheduling_strategy=strategy).remote(self.cfg)

    def check_room(self) -> None:
        """Raise `NoRoom` when a node of the cluster is no longer alive and the alive ones cannot hold
        the layout's node groups (one GPU, or on CPU one CPU, a slot). A cluster that lost no node
        is waited on, up to `cluster.timeout_s`: an autoscaler may be adding the nodes."""
        nodes = ray.nodes()
        lost = [f"{n['NodeID'][:8]} ({n['NodeManagerAddress']})" for n in nodes if not n["Alive"]]
        kind = "GPU" if self.use_gpu else "CPU"
        alive = [int(n["Resources"].get(kind, 0)) for n in nodes if n["Alive"]]
        why = missing_room([len(g) for g in self.node_groups], alive)
        if why is None or not lost:
            return
        raise NoRoom(
            f"the Ray cluster has no room for the run's layout ({kind} slots): {why}; nodes no longer "
            f"alive: {', '.join(lost)}. Fix: add a node to the cluster (ray start --address=HEAD_IP:PORT)"
        )

    def _describe(self, slots: list[int]) -> None:
        """Ask the actors of `slots` where they run; log each and rewrite actors.json."""
        infos = self.wait([self.slots[s].address.remote() for s in slots], "start", slots, watch_room=True)
        for s, (ip, port, pid, node_id, device) in zip(slots, infos):
            self.hosts[s] = f"{ip} (pid {pid})"
            self.addresses[s] = (ip, port)
            self.records[s] = {"node_ip": ip, "node_id": node_id, "pid": pid, "device": device}
            log.info("actor: %s on %s (node %s, pid %d, %s)", self.labels[s], ip, node_id[:8], pid, device)
        rows = [
            {"role": r, "rank": k, **self.records[s]}
            for s in range(len(self.slots))
            for r, k in self.roles[s]
        ]
        self.run_dir.mkdir(parents=True, exist_ok=True)
        write_text(self.run_dir / ACTORS_FILE, json.dumps(rows, indent=1) + "\n")

    def replace(self, slot: int) -> None:
        """Kill the actor of `slot` (dead or hung) and start a fresh one in its place (the same bundle
        of its node group); the caller builds its workers."""
        ray.kill(self.slots[slot], no_restart=True)
        self.check_room()
        self.slots[slot] = self._new_actor(slot)
        self._describe([slot])

    def call(self, slots: list[int], method: str, *args: Any) -> list[Any]:
        """Refs of `method(*args)` on each slot's actor (no waiting)."""
        return [getattr(self.slots[s], method).remote(*args) for s in slots]

    def wait(self, refs: list[Any], stage: str, slots: list[int], *, watch_room: bool = False) -> list[Any]:
        """Results of `refs` (ref i from `slots[i]`) in order; the first failure or a wait of more than
        `cluster.timeout_s` raises `SlotFailure`. `watch_room`: actors wait for their place, so the
        cluster's room is checked every second (a lost node is seen at once, not at the timeout)."""
        index = {ref: i for i, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        deadline = time.monotonic() + self.timeout_s
        while pending:
            left = max(deadline - time.monotonic(), 0)
            ready, pending = ray.wait(pending, num_returns=1, timeout=min(left, 1.0) if watch_room else left)
            if not ready and watch_room and left > 1.0:
                self.check_room()
                continue
            if not ready:
                raise self.late([slots[index[r]] for r in pending], stage)
            i = index[ready[0]]
            results[i] = self.get(ready[0], stage, slots[i])
        return results

    def wait_each(self, refs: list[Any], stage: str, slots: list[int], extra_s: float = 0.0) -> list[Any]:
        """Each ref's value, or the `SlotFailure` of its slot (one not in within cluster.timeout_s +
        `extra_s` counts as hung): a failed worker does not take the others' results with it."""
        _, late = ray.wait(refs, num_returns=len(refs), timeout=self.timeout_s + extra_s)
        out: list[Any] = []
        for ref, slot in zip(refs, slots):
            try:
                if ref in late:
                    raise self.late([slot], stage)
                out.append(self.get(ref, stage, slot))
            except SlotFailure as e:
                out.append(e)
        return out

    def get(self, ref: Any, stage: str, slot: int) -> Any:
        """The value of a ready `ref` from `slot`, or `SlotFailure` if its worker failed."""
        try:
            return ray.get(ref)
        except ACTOR_ERRORS as e:
            first = str(e).splitlines()[0] if str(e) else ""
            raise SlotFailure(
                f"{self._where([slot])} failed in stage {stage!r}: {type(e).__name__}: {first}",
                [slot],
                lost=not isinstance(e, RayTaskError),
            ) from None

    def late(self, slots: list[int], stage: str) -> SlotFailure:
        """The failure of `slots` that did not finish `stage` in time (a collective whose peer died
        never completes: the wait's timeout makes it that peer's failure)."""
        return SlotFailure(
            f"{self._where(slots)} did not finish stage {stage!r} within cluster.timeout_s={self.timeout_s:g} s",
            [s for s in slots if s >= 0],
        )

    def _where(self, slots: list[int]) -> str:
        if not slots or any(s < 0 for s in slots):
            return "the cluster"
        return ", ".join(f"{self.labels[s]} on {self.hosts[s] or 'a node not known yet'}" for s in slots)

    def close(self) -> None:
        for actor in self.slots:
            ray.kill(actor, no_restart=True)
        self.slots = []
        for pg in getattr(self, "pgs", []):
            remove_placement_group(pg)
        self.pgs = []
        if self._owns_ray:
            ray.shutdown()  # a later run in this process starts afresh
            self._owns_ray = False


class Refs:
    """A `Pending` over refs from several slots, merged by `combine` once all are in."""

    def __init__(
        self, actors: Actors, refs: list[Any], stage: str, slots: list[int], combine: Callable
    ) -> None:
        self.actors, self.refs, self.stage, self.slots, self.combine = actors, refs, stage, slots, combine

    def result(self) -> Any:
        return self.combine(self.actors.wait(self.refs, self.stage, self.slots))

    def done(self) -> bool:
        ready, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        return len(ready) == len(self.refs)


def first(results: list[Any]) -> Any:
    return results[0]


def _label(placement: Placement, slot: int) -> str:
    if placement.colocated:
        return f"rank {slot}"
    if slot in placement.train_slots:
        return f"training rank {placement.train_slots.index(slot)}"
    return f"rollout rank {placement.rollout_slots.index(slot)}"
