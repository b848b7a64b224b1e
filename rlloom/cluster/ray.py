"""Ray groups: one actor per GPU (or CPU slot) in one placement group, as `placement.py` lays them
out. Imported only when cluster.mode=ray.

`RayTrainGroup` fans each call out to every training rank and returns a `Pending` at once;
`RayRolloutGroup` streams chunks of prompts to its replicas by load; the weight sync is the
transport `weight_sync/build.transport` picks: in place inside each colocated actor, or broadcast
from every training rank (each sending the weights it owns: its routed experts, a share of the
dense tensors) into a separate rollout pool. Arguments
go to the object store once (`ray.put`) and every actor reads the same copy. A worker that dies,
raises or hangs beyond `cluster.timeout_s` stops the run with `WorkerFailure` naming its rank,
host and stage; all actors are then killed so that `trainer.resume=auto` can continue cleanly.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch

from rlloom.cluster.base import WorkerFailure
from rlloom.cluster.placement import Placement, rollout_tp
from rlloom.cluster.ray_generate import QueuedGeneration
from rlloom.config import RunConfig
from rlloom.data.types import PolicyUpdate, RolloutBatch, ValueUpdate
from rlloom.determinism import determinism_env
from rlloom.engines.rollout import SamplingParams
from rlloom.workers.flights import StreamRequest, StreamResult

try:
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("cluster.mode=ray needs Ray: pip install 'rlloom[ray]'") from e

from rlloom.cluster.ray_actor import SlotActor  # noqa: E402  (needs ray)
from rlloom.weight_sync.broadcast import SyncGroupSpec  # noqa: E402
from rlloom.weight_sync.build import transport  # noqa: E402

ACTOR_ERRORS = (RayActorError, RayTaskError, GetTimeoutError)


class Actors:
    """The run's actors, one per slot, and the waiting that turns their failures into `WorkerFailure`."""

    def __init__(self, cfg: RunConfig, placement: Placement) -> None:
        self.timeout_s = cfg.cluster.timeout_s
        use_gpu = cfg.cluster.device == "cuda" or (cfg.cluster.device == "auto" and torch.cuda.is_available())
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            # A local CPU cluster gets a slot per actor even on a machine with fewer cores.
            cpus = None if use_gpu or cfg.cluster.address else max(os.cpu_count() or 1, placement.num_slots)
            ray.init(
                address=cfg.cluster.address or None,
                num_cpus=cpus,
                include_dashboard=False,
                log_to_driver=True,
            )
        self.labels = [_label(placement, s) for s in range(placement.num_slots)]
        bundle = {"GPU": 1, "CPU": 1} if use_gpu else {"CPU": 1}
        self.pg = placement_group([bundle] * placement.num_slots, strategy="PACK")
        self.hosts: list[str] = []
        self.wait([self.pg.ready()], "placement group", [-1])
        # The actors see the driver's RLLOOM_/NCCL_/TORCH_ settings, also in a cluster joined by address.
        env = {k: v for k, v in os.environ.items() if k.startswith(("RLLOOM_", "NCCL_", "TORCH_"))}
        env.update(determinism_env(cfg.trainer.deterministic))  # set before the actor's CUDA starts
        actor_cls = ray.remote(num_cpus=1, num_gpus=1 if use_gpu else 0, runtime_env={"env_vars": env})(
            SlotActor
        )
        self.slots = [
            actor_cls.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=s)
            ).remote(cfg)
            for s in range(placement.num_slots)
        ]
        addresses = self.wait([a.address.remote() for a in self.slots], "start", list(range(len(self.slots))))
        self.hosts = [f"{ip} (pid {pid})" for ip, _, pid in addresses]
        self.addresses = [(ip, port) for ip, port, _ in addresses]

    def call(self, slots: list[int], method: str, *args: Any) -> list[Any]:
        """Refs of `method(*args)` on each slot's actor (no waiting)."""
        return [getattr(self.slots[s], method).remote(*args) for s in slots]

    def wait(self, refs: list[Any], stage: str, slots: list[int]) -> list[Any]:
        """Results of `refs` (ref i from `slots[i]`) in order; the first failure or a wait of more than
        `cluster.timeout_s` raises `WorkerFailure`."""
        index = {ref: i for i, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        deadline = time.monotonic() + self.timeout_s
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(deadline - time.monotonic(), 0))
            if not ready:
                self.fail_late([slots[index[r]] for r in pending], stage)
            i = index[ready[0]]
            results[i] = self.get(ready[0], stage, slots[i])
        return results

    def get(self, ref: Any, stage: str, slot: int) -> Any:
        """The value of a ready `ref` from `slot`, or `WorkerFailure` if its worker failed."""
        try:
            return ray.get(ref)
        except ACTOR_ERRORS as e:
            first = str(e).splitlines()[0] if str(e) else ""
            self.fail(f"{self._where([slot])} failed in stage {stage!r}: {type(e).__name__}: {first}")

    def fail_late(self, slots: list[int], stage: str) -> None:
        self.fail(
            f"{self._where(slots)} did not finish stage {stage!r} within cluster.timeout_s={self.timeout_s:g} s"
        )

    def _where(self, slots: list[int]) -> str:
        if not self.hosts or any(s < 0 for s in slots):
            return "the cluster"
        return ", ".join(f"{self.labels[s]} on {self.hosts[s]}" for s in slots)

    def fail(self, message: str) -> None:
        self.close()
        raise WorkerFailure(
            message
            + ". The run stopped; restart with trainer.resume=auto to continue from the last checkpoint."
        )

    def close(self) -> None:
        for actor in getattr(self, "slots", []):
            ray.kill(actor, no_restart=True)
        self.slots = []
        if getattr(self, "pg", None) is not None:
            remove_placement_group(self.pg)
            self.pg = None
        if getattr(self, "_owns_ray", False):
            ray.shutdown()  # a later run in this process starts afresh (e.g. a resumed run)
            self._owns_ray = False


def _label(placement: Placement, slot: int) -> str:
    if placement.colocated:
        return f"rank {slot}"
    if slot in placement.train_slots:
        return f"training rank {placement.train_slots.index(slot)}"
    return f"rollout rank {placement.rollout_slots.index(slot)}"


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


def _first(results: list[Any]) -> Any:
    return results[0]


def _on_every_slot(
    actors: Actors, slots: list[int], worker: str, method: str, args: tuple, stage: str
) -> Refs:
    """`method(*args)` on the worker `worker` (the actor's `on_train`, `on_critic`) of every slot, the
    batch-sized arguments put in the object store once for all of them; rank 0's result is the group's."""
    args = tuple(ray.put(a) if isinstance(a, RolloutBatch | PolicyUpdate | ValueUpdate) else a for a in args)
    return Refs(actors, actors.call(slots, worker, method, *args), stage, slots, _first)


class RayTrainGroup:
    """The training ranks: every call goes to all of them with the same (object-store) arguments;
    their results agree, so rank 0's is the group's."""

    def __init__(self, actors: Actors, slots: list[int]) -> None:
        self.actors, self.slots = actors, slots

    def _all(self, method: str, *args: Any) -> Refs:
        return _on_every_slot(self.actors, self.slots, "on_train", method, args, method)

    @property
    def version(self) -> int:
        return self.actors.wait(self.actors.call(self.slots[:1], "versions"), "version", self.slots[:1])[0][0]

    def old_logprobs(self, batch: RolloutBatch) -> Refs:
        return self._all("old_logprobs", batch)

    def ref_logprobs(self, batch: RolloutBatch) -> Refs:
        return self._all("ref_logprobs", batch)

    def update_policy(self, update: PolicyUpdate) -> Refs:
        return self._all("update_policy", update)

    def offload(self) -> Refs:
        return self._all("offload")

    def onload(self) -> Refs:
        return self._all("onload")

    def freeze_heap(self) -> Refs:
        return Refs(
            self.actors, self.actors.call(self.slots, "freeze_heap"), "freeze_heap", self.slots, _first
        )

    def save(self, path: str) -> Refs:
        return self._all("save", path)

    def load(self, path: str) -> Refs:
        return self._all("load", path)

    def save_hf(self, path: str) -> Refs:
        return self._all("save_hf", path)

    def close(self) -> None:
        self.actors.close()


class RayCriticGroup:
    """PPO's critic on the training ranks' actors (each hosts a `CriticWorker` beside its training
    worker); calls go to all of them, rank 0's result is the group's."""

    def __init__(self, actors: Actors, slots: list[int]) -> None:
        self.actors, self.slots = actors, slots

    def _all(self, method: str, *args: Any) -> Refs:
        return _on_every_slot(self.actors, self.slots, "on_critic", method, args, f"critic {method}")

    def values(self, batch: RolloutBatch) -> Refs:
        return self._all("values", batch)

    def update_critic(self, update: ValueUpdate) -> Refs:
        return self._all("update_critic", update)

    def save(self, path: str) -> Refs:
        return self._all("save", path)

    def load(self, path: str) -> Refs:
        return self._all("load", path)


class RayRolloutGroup:
    """The rollout replicas (`replicas[r]` = the slots of replica r's ranks, rank 0 first)."""

    def __init__(self, actors: Actors, replicas: list[list[int]], *, max_num_seqs: int) -> None:
        self.actors, self.replicas, self.max_num_seqs = actors, replicas, max_num_seqs
        self.slots = [s for r in replicas for s in r]
        self._version = 0

    @property
    def version(self) -> int:
        return self._version

    def generate(self, prompts: list[list[int]], sampling: list[SamplingParams]) -> QueuedGeneration:
        return QueuedGeneration(self.actors, self.replicas, prompts, sampling, max_num_seqs=self.max_num_seqs)

    # ---- the step-level producers (every rank of a replica gets each call; its rank 0 speaks) -----

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    def _streams(self, method: str, *args: Any) -> list[Any]:
        """`method(*args)` on every rollout rank; the results of each replica's rank 0."""
        results = self.actors.wait(
            self.actors.call(self.slots, "on_rollout", method, *args), method, self.slots
        )
        heads = {r[0] for r in self.replicas}
        return [x for s, x in zip(self.slots, results) if s in heads]

    def stream_add(self, replica: int, requests: list[StreamRequest]) -> None:
        slots = self.replicas[replica]
        refs = self.actors.call(slots, "on_rollout", "stream_add", ray.put(requests))
        self.actors.wait(refs, "generate", slots)

    def stream_poll(self, timeout_s: float) -> list[StreamResult]:
        return [x for results in self._streams("stream_poll", timeout_s) for x in results]

    def stream_abort(self) -> int:
        return sum(self._streams("stream_abort"))

    def stream_resume(self, keep: bool) -> int:
        return sum(self._streams("stream_resume", keep))

    def stream_drop(self) -> int:
        return sum(self._streams("stream_drop"))

    @property
    def stream_busy_s(self) -> float:
        """The replicas' mean busy time (their mean idle fraction follows from it)."""
        heads = [r[0] for r in self.replicas]
        busy = self.actors.wait(self.actors.call(heads, "on_rollout", "stream_busy"), "stream_busy", heads)
        return sum(busy) / len(busy)

    def sleep(self) -> Refs:
        return Refs(
            self.actors, self.actors.call(self.slots, "on_rollout", "sleep"), "sleep", self.slots, _first
        )

    def wake(self) -> Refs:
        return Refs(
            self.actors, self.actors.call(self.slots, "on_rollout", "wake"), "wake", self.slots, _first
        )

    def freeze_heap(self) -> Refs:
        return Refs(
            self.actors, self.actors.call(self.slots, "freeze_heap"), "freeze_heap", self.slots, _first
        )

    def close(self) -> None:
        self.actors.close()


class InPlaceSync:
    """Colocated: every actor copies its training weights into its own rollout rank."""

    def __init__(self, train: RayTrainGroup, rollout: RayRolloutGroup) -> None:
        self.train, self.rollout = train, rollout

    def sync(self) -> dict[str, float]:
        actors, slots = self.train.actors, self.train.slots
        metrics = actors.wait(actors.call(slots, "sync_inplace"), "sync", slots)[0]
        self.rollout._version = self.train.version
        return metrics


class BroadcastSync:
    """Separate pools: every training rank broadcasts what it owns (owner-only: its routed experts,
    never all-gathered over expert parallelism, and its share of the dense tensors) to the rollout
    ranks that hold it, over the sync group (`weight_sync/broadcast.py`, outside both worlds). The
    receivers check what arrived before loading it."""

    def __init__(self, train: RayTrainGroup, rollout: RayRolloutGroup) -> None:
        self.train, self.rollout = train, rollout

    def sync(self) -> dict[str, float]:
        actors, tslots, rslots = self.train.actors, self.train.slots, self.rollout.slots
        refs = actors.call(tslots, "send_weights") + actors.call(rslots, "receive_weights")
        results = actors.wait(refs, "sync", tslots + rslots)
        self.rollout._version = results[len(tslots)]
        return _sent(results[: len(tslots)])


def _sent(reports: list[dict[str, float]]) -> dict[str, float]:
    """The senders' metrics as one: bytes and pieces add up, the time is the slowest sender's."""
    out = dict(reports[0])
    for key in ("sync/gb", "sync/num_tensors"):
        out[key] = sum(r[key] for r in reports)
    out["sync/ms"] = max(r["sync/ms"] for r in reports)
    out["sync/ms_per_gb"] = out["sync/ms"] / out["sync/gb"] if out["sync/gb"] > 0 else 0.0
    return out


def build_ray_groups(
    cfg: RunConfig, placement: Placement
) -> tuple[RayTrainGroup, RayRolloutGroup, Any, RayCriticGroup | None]:
    """Start one actor per slot, join the training world (and with separate placement the rollout
    world, when replicas span several ranks), then build the workers (a training rank builds its
    critic rank too when the estimator needs one)."""
    actors = Actors(cfg, placement)
    tslots, rslots = placement.train_slots, placement.rollout_slots
    master = actors.addresses[tslots[0]]
    refs = [actors.slots[s].start_train.remote(i, len(tslots), master) for i, s in enumerate(tslots)]
    actors.wait(refs, "setup (training)", tslots)
    multi_rank = any(len(r) > 1 for r in placement.replicas)
    world = (len(rslots), actors.addresses[rslots[0]]) if not placement.colocated and multi_rank else None
    refs = [actors.slots[s].start_rollout.remote(j, placement.replicas, world) for j, s in enumerate(rslots)]
    actors.wait(refs, "setup (rollout)", rslots)
    broadcast = transport(cfg) == "broadcast"
    if broadcast:
        join_sync_group(cfg, actors, tslots, rslots)
    train = RayTrainGroup(actors, tslots)
    replicas = [[rslots[j] for j in r] for r in placement.replicas]
    rollout = RayRolloutGroup(actors, replicas, max_num_seqs=cfg.rollout.max_num_seqs)
    sync = BroadcastSync(train, rollout) if broadcast else InPlaceSync(train, rollout)
    critic = RayCriticGroup(actors, tslots) if cfg.algorithm.uses_critic else None
    return train, rollout, sync, critic


def join_sync_group(cfg: RunConfig, actors: Actors, senders: list[int], receivers: list[int]) -> None:
    """Every training rank (sync rank s = training rank s; rank 0 hosts the group's store on a fresh
    port) and every rollout rank (sync ranks S..) join the broadcast sync group together."""
    host, port = actors.wait(actors.call(senders[:1], "address"), "sync group", senders[:1])[0][:2]
    spec = SyncGroupSpec(
        host=host,
        port=port,
        num_senders=len(senders),
        num_receivers=len(receivers),
        rollout_tp=rollout_tp(cfg),
        timeout_s=cfg.sync.timeout_s,
    )
    slots = [*senders, *receivers]
    refs = [actors.slots[s].join_sync.remote(spec, rank) for rank, s in enumerate(slots)]
    actors.wait(refs, "sync group", slots)
