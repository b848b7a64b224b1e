"""Ray groups: one actor per GPU (or CPU slot) in one placement group, as `placement.py` lays them
out. Imported only when cluster.mode=ray.

`RayTrainGroup` fans each call out to every training rank and returns a `Pending` at once;
`RayRolloutGroup` streams chunks of prompts to its replicas by load; the weight sync is the
transport `weight_sync/build.transport` picks: in place inside each colocated actor, or broadcast
from every training rank (each sending the weights it owns: its routed experts, a share of the
dense tensors) into a separate rollout pool. Arguments
go to the object store once (`ray.put`) and every actor reads the same copy.

A worker that dies, raises or hangs beyond `cluster.timeout_s` raises `WorkerFailure` (a
`SlotFailure` naming its rank, host and stage). Under separate placement with one-rank replicas, in
trainer.mode=sync, a rollout replica's failure is absorbed: a fresh actor takes its place, the sync group is joined
afresh, the weights are synced to the current version and the requests the replica held are sent
again (their seeds make the same samples; samples already delivered are not delivered twice),
up to `trainer.max_restarts` times a run. Any other failure goes up to the controller
(`trainer/run.py`), which restarts the run from its newest checkpoint. A weight sync that fails
with every actor alive is retried once in a fresh sync group.
"""

from __future__ import annotations

import logging
from typing import Any

from rlloom.cluster.placement import Placement, rollout_tp
from rlloom.config import RunConfig
from rlloom.data.types import PolicyUpdate, RolloutBatch, ValueUpdate

try:
    import ray
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("cluster.mode=ray needs Ray: pip install 'rlloom[ray]'") from e

from rlloom.cluster.ray_rollout import RayRolloutGroup  # noqa: E402  (needs ray)
from rlloom.cluster.ray_slots import Actors, Refs, SlotFailure, first  # noqa: E402
from rlloom.weight_sync.broadcast import SyncGroupSpec  # noqa: E402
from rlloom.weight_sync.build import transport  # noqa: E402

log = logging.getLogger(__name__)


def _on_every_slot(
    actors: Actors, slots: list[int], worker: str, method: str, args: tuple, stage: str
) -> Refs:
    """`method(*args)` on the worker `worker` (the actor's `on_train`, `on_critic`) of every slot, the
    batch-sized arguments put in the object store once for all of them; rank 0's result is the group's."""
    args = tuple(ray.put(a) if isinstance(a, RolloutBatch | PolicyUpdate | ValueUpdate) else a for a in args)
    return Refs(actors, actors.call(slots, worker, method, *args), stage, slots, first)


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

    def teacher_logprobs(self, batch: RolloutBatch) -> Refs:
        return self._all("teacher_logprobs", batch)

    def update_policy(self, update: PolicyUpdate) -> Refs:
        return self._all("update_policy", update)

    def update_sft(self, batch: RolloutBatch, normalizer: float) -> Refs:
        return self._all("update_sft", batch, normalizer)

    def offload(self) -> Refs:
        return self._all("offload")

    def onload(self) -> Refs:
        return self._all("onload")

    def freeze_heap(self) -> Refs:
        return Refs(
            self.actors, self.actors.call(self.slots, "freeze_heap"), "freeze_heap", self.slots, first
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
    receivers check what arrived before loading it. A failed sync is retried once in a fresh sync
    group, after a lost rollout actor is replaced; a lost training actor goes up to the controller."""

    def __init__(self, cfg: RunConfig, train: RayTrainGroup, rollout: RayRolloutGroup) -> None:
        self.cfg, self.train, self.rollout = cfg, train, rollout

    def sync(self) -> dict[str, float]:
        try:
            return self.sync_once()
        except SlotFailure as e:
            if e.lost and any(s in self.train.slots for s in e.slots):
                raise
            log.warning("weight sync failed (%s); retrying once in a fresh sync group", e)
            lost = sorted({self.rollout.replica_of[s] for s in e.slots if e.lost})
            for replica in lost:  # its replacement joins a fresh group and syncs
                self.rollout.replace(replica, e)
            if not lost:
                join_sync_group(self.cfg, self.train.actors, self.train.slots, self.rollout.slots)
            return self.sync_once()

    def sync_once(self) -> dict[str, float]:
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
    try:
        return _build(cfg, placement, actors)
    except BaseException:
        actors.close()  # a failed start leaves no actor behind
        raise


def _build(
    cfg: RunConfig, placement: Placement, actors: Actors
) -> tuple[RayTrainGroup, RayRolloutGroup, Any, RayCriticGroup | None]:
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
    # A replica is replaced in place only when it is alone in its world (separate, one rank each) and
    # the step waits for its samples (trainer.mode=sync): in the asynchronous modes the training
    # weights move on while it generates, so its requests sent again would sample under newer ones;
    # there the run restarts from its checkpoint instead (trainer/run.py), which is exact.
    replaceable = broadcast and not placement.colocated and not multi_rank and cfg.trainer.mode == "sync"

    def recover(replica: int) -> None:
        """Fresh actors for `replica`'s slots, a fresh sync group for all, the current weights."""
        slots = replicas[replica]
        for s in slots:
            actors.replace(s)
        refs = [
            actors.slots[s].start_rollout.remote(rslots.index(s), placement.replicas, None) for s in slots
        ]
        actors.wait(refs, "setup (rollout)", slots)
        join_sync_group(cfg, actors, tslots, rslots)
        sync.sync_once()

    rollout = RayRolloutGroup(
        actors,
        replicas,
        max_num_seqs=cfg.rollout.max_num_seqs,
        max_restarts=cfg.trainer.max_restarts,
        recover=recover if replaceable else None,
    )
    sync = BroadcastSync(cfg, train, rollout) if broadcast else InPlaceSync(train, rollout)
    critic = RayCriticGroup(actors, tslots) if cfg.algorithm.uses_critic else None
    return train, rollout, sync, critic


def build_ray_train_group(cfg: RunConfig, placement: Placement) -> RayTrainGroup:
    """Start one actor per training slot and join the training world (`rlloom sft`: no rollout)."""
    actors = Actors(cfg, placement)
    slots = placement.train_slots
    master = actors.addresses[slots[0]]
    refs = [actors.slots[s].start_train.remote(i, len(slots), master) for i, s in enumerate(slots)]
    actors.wait(refs, "setup (training)", slots)
    return RayTrainGroup(actors, slots)


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
