"""`RayRolloutGroup`: the rollout replicas as Ray actors, and the replacing of a replica that fails.

The group keeps the stream requests each replica holds: every request sent to it since it was last
empty (all it had been sent delivered in full), in the order sent. When a replica's actor dies or
hangs and the group has a `recover` (separate placement, one-rank replicas), `recover(replica)`
starts a fresh actor in its place and syncs it to the current weights; the held requests are sent
again, all of them at once and with their same seeds, so they make the same samples, and a sample
that was delivered before the failure is not delivered twice. Requests delivered in full are sent
again too: the fresh engine then runs the batches the lost one ran (the same requests admitted
together), and with batch-dependent GPU kernels a token's logits depend on its batch, so the
replica's step is bit for bit the uninterrupted one's (in trainer.mode=sync a step's requests reach
an empty replica in one call; a later call, as dynamic sampling's next round, joined the lost
engine at a step that timing chose). At most `trainer.max_restarts` replacements a
run; past that, or without a `recover`, the failure goes up to the controller, as does a replacement
the cluster has no room for (`NoRoom`: its node was lost).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import ray

from rlloom.cluster.ray_generate import QueuedGeneration
from rlloom.cluster.ray_slots import Actors, NoRoom, Refs, SlotFailure, first
from rlloom.data.images import ImageInputs
from rlloom.engines.rollout import Partial, SamplingParams
from rlloom.workers.flights import StreamRequest, StreamResult

log = logging.getLogger(__name__)


class RayRolloutGroup:
    """The rollout replicas (`replicas[r]` = the slots of replica r's ranks, rank 0 first)."""

    def __init__(
        self,
        actors: Actors,
        replicas: list[list[int]],
        *,
        max_num_seqs: int,
        max_restarts: int = 0,
        recover: Callable[[int], None] | None = None,
    ) -> None:
        """`recover(replica)`: start fresh actors for the replica's slots, with the current weights."""
        self.actors, self.replicas, self.max_num_seqs = actors, replicas, max_num_seqs
        self.slots = [s for r in replicas for s in r]
        self.replica_of = {s: i for i, r in enumerate(replicas) for s in r}
        self._version = 0
        self.max_restarts, self.recover = max_restarts, recover
        self.restarts = 0
        """Replicas replaced so far (the metric cluster/rollout_restarts)."""
        self.held: list[dict[str, StreamRequest]] = [{} for _ in replicas]
        """Per replica: the requests sent to it since it was last empty, by id, in the order sent."""
        self.delivered: dict[str, set[int]] = {}
        """Per held request: the sample indices delivered so far."""
        self.resend: set[int] = set()
        """Replaced replicas whose held requests wait to be sent again (not while aborting)."""

    @property
    def version(self) -> int:
        return self._version

    def generate(
        self,
        prompts: list[list[int]],
        sampling: list[SamplingParams],
        images: list[ImageInputs | None] | None = None,
    ) -> QueuedGeneration:
        return QueuedGeneration(
            self.actors, self.replicas, prompts, sampling, images, max_num_seqs=self.max_num_seqs
        )

    # ---- the step-level producers (every rank of a replica gets each call; its rank 0 speaks) -----

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    def _streams(self, method: str, *args: Any, extra_s: float = 0.0) -> list[tuple[int, Any]]:
        """`method(*args)` on every rollout rank: (replica, its rank 0's result) of the replicas that
        did not fail; the failed ones are replaced (or their failure raised)."""
        refs = self.actors.call(self.slots, "on_rollout", method, *args)
        results = self.actors.wait_each(refs, method, self.slots, extra_s)
        failed: dict[int, SlotFailure] = {}
        for s, x in zip(self.slots, results):
            if isinstance(x, SlotFailure):
                failed.setdefault(self.replica_of[s], x)
        for replica, failure in sorted(failed.items()):
            self.replace(replica, failure)
        heads = {r[0] for r in self.replicas}
        return [
            (self.replica_of[s], x)
            for s, x in zip(self.slots, results)
            if s in heads and self.replica_of[s] not in failed
        ]

    def replace(self, replica: int, failure: SlotFailure) -> None:
        """A fresh actor for each rank of `replica` (via `recover`); its held requests are sent again
        at the next add, poll or resume. Raises `failure` when that is not possible or allowed."""
        if self.recover is None or self.restarts >= self.max_restarts:
            raise failure
        self.restarts += 1
        start = time.monotonic()
        try:
            self.recover(replica)
        except NoRoom as e:
            raise NoRoom(f"{str(failure).rstrip('.')}, and {e}") from e
        self.resend.add(replica)
        log.warning(
            "rollout restart %d of trainer.max_restarts=%d: %s; replica %d replaced in %.1f s, %d requests "
            "sent again",
            self.restarts,
            self.max_restarts,
            failure,
            replica,
            time.monotonic() - start,
            len(self.held[replica]),
        )

    def _send(self, replica: int, requests: list[StreamRequest]) -> None:
        for r in requests:
            self.held[replica][r.request_id] = r
            self.delivered.setdefault(r.request_id, set())
        slots = self.replicas[replica]
        refs = self.actors.call(slots, "on_rollout", "stream_add", ray.put(requests))
        for x in self.actors.wait_each(refs, "generate", slots):
            if isinstance(x, SlotFailure):
                self.replace(replica, x)
                return  # the replacement sends every held request, these too

    def _resend(self) -> None:
        while self.resend:
            replica = self.resend.pop()
            self._send(replica, list(self.held[replica].values()))

    def _fresh(self, results: list[StreamResult | Partial]) -> list[StreamResult | Partial]:
        """The results not delivered before (a request sent again makes its samples again); the
        tokens so far of samples not delivered pass (a re-run sample's start again)."""
        out = []
        for x in results:
            if isinstance(x, Partial):
                if x.sample_index not in self.delivered.get(x.request_id, ()):
                    out.append(x)
                continue
            c = x.completion
            got = self.delivered.get(c.request_id)
            if got is None or c.sample_index in got:
                continue
            got.add(c.sample_index)
            out.append(x)
        self._forget_delivered()
        return out

    def _forget_delivered(self) -> None:
        """Drop the held requests no replacement needs: a replica's all at once when it has delivered
        every one in full (it is empty, so a request sent later starts in an empty engine, as in a
        fresh one); without a `recover` (nothing is sent again: the asynchronous modes, whose
        replicas are seldom empty) each one as soon as it is delivered in full."""
        for held in self.held:
            done = [i for i, r in held.items() if len(self.delivered[i]) >= max(r.sampling.n, 1)]
            if self.recover is None or len(done) == len(held):
                for request_id in done:
                    del held[request_id], self.delivered[request_id]

    def stream_add(self, replica: int, requests: list[StreamRequest]) -> None:
        self._send(replica, requests)
        self._resend()

    def stream_poll(self, timeout_s: float) -> list[StreamResult | Partial]:
        results = [x for _, xs in self._streams("stream_poll", timeout_s, extra_s=timeout_s) for x in xs]
        self._resend()
        return self._fresh(results)

    def stream_abort(self) -> int:
        return sum(x for _, x in self._streams("stream_abort"))

    def stream_resume(self, keep: bool) -> int:
        discarded = sum(x for _, x in self._streams("stream_resume", keep))
        self._resend()
        return discarded

    def stream_drop(self) -> int:
        discarded = sum(x for _, x in self._streams("stream_drop"))
        for held in self.held:
            held.clear()
        self.delivered.clear()
        self.resend.clear()
        return discarded

    @property
    def stream_busy_s(self) -> float:
        """The replicas' mean busy time (their mean idle fraction follows from it)."""
        busy = [x for _, x in self._streams("stream_busy")]
        return sum(busy) / max(len(busy), 1)

    def _on_all(self, method: str) -> Refs:
        return Refs(
            self.actors, self.actors.call(self.slots, "on_rollout", method), method, self.slots, first
        )

    def sleep(self) -> Refs:
        return self._on_all("sleep")

    def wake(self) -> Refs:
        return self._on_all("wake")

    def freeze_heap(self) -> Refs:
        return Refs(
            self.actors, self.actors.call(self.slots, "freeze_heap"), "freeze_heap", self.slots, first
        )

    def close(self) -> None:
        self.actors.close()
