"""Generation over the rollout replicas by load: the prompts are cut into chunks and a work queue
hands the next chunk to whichever replica finishes first, instead of fixed prompt ranges per
replica. Every rank of a replica gets the chunk (one object-store copy) and rank 0's completions
are the replica's; the results come back in prompt order. Seeded sampling does not depend on the
batch a prompt ran in, so the completions do not depend on which replica ran which chunk."""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from typing import Any

import ray

from rlloom.data.images import ImageInputs
from rlloom.engines.rollout import Completion, SamplingParams

CHUNKS_PER_REPLICA = 4
"""At most this many chunks per replica, to even the load out."""


def chunk_bounds(num_prompts: int, num_replicas: int, min_prompts: int = 1) -> list[tuple[int, int]]:
    """[lo, hi) prompt ranges of the chunks. A replica runs one chunk at a time, so a chunk keeps at
    least `min_prompts` prompts (enough to fill the engine's batch, `rollout.max_num_seqs`) unless
    that would leave a replica idle; then up to `CHUNKS_PER_REPLICA` chunks per replica. One replica
    gets one chunk. Examples: (10, 2, 1) -> 8 chunks; (64, 2, 32) -> [(0, 32), (32, 64)];
    (1024, 2, 32) -> 8 chunks of 128."""
    if num_prompts == 0:
        return []
    by_size = num_prompts // max(min_prompts, 1)
    num_chunks = max(num_replicas, min(num_replicas * CHUNKS_PER_REPLICA, by_size))
    num_chunks = 1 if num_replicas == 1 else min(num_chunks, num_prompts)
    bounds = [num_prompts * c // num_chunks for c in range(num_chunks + 1)]
    return [(lo, hi) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]


class QueuedGeneration:
    """A `Pending[list[Completion]]`: the first chunk of each replica is sent at once; `done()` and
    `result()` hand out the rest as replicas finish. A replica that fails or makes no progress for
    `cluster.timeout_s` raises `WorkerFailure` through `actors` (see ray.py's `Actors`)."""

    def __init__(
        self,
        actors: Any,
        replicas: list[list[int]],
        prompts: list[list[int]],
        sampling: list[SamplingParams],
        images: list[ImageInputs | None] | None = None,
        *,
        max_num_seqs: int,
    ) -> None:
        self.actors, self.replicas = actors, replicas
        self.prompts, self.sampling, self.images = prompts, sampling, images
        samples = max((s.n for s in sampling), default=1)
        self.chunks = chunk_bounds(len(prompts), len(replicas), min_prompts=max_num_seqs // samples)
        self.todo = deque(range(len(self.chunks)))
        self.results: list[list[Completion] | None] = [None] * len(self.chunks)
        self.running: dict[Any, tuple[int, int, int]] = {}  # ref -> (replica, chunk, rank in replica)
        self.left: dict[int, int] = {}  # chunk -> refs not yet in
        for r in range(len(replicas)):
            self._send(r)
        self.last_progress = time.monotonic()

    def _send(self, replica: int) -> None:
        if not self.todo:
            return
        c = self.todo.popleft()
        lo, hi = self.chunks[c]
        prompts, sampling = ray.put(self.prompts[lo:hi]), ray.put(self.sampling[lo:hi])
        images = None if self.images is None else ray.put(self.images[lo:hi])
        slots = self.replicas[replica]
        self.left[c] = len(slots)
        for rank, ref in enumerate(
            self.actors.call(slots, "on_rollout", "generate", prompts, sampling, images)
        ):
            self.running[ref] = (replica, c, rank)

    def _step(self, timeout: float) -> None:
        """Take in the refs that are ready (waiting up to `timeout`), sending more chunks as replicas free up."""
        ready, _ = ray.wait(list(self.running), num_returns=1, timeout=timeout)
        for ref in ready:
            replica, c, rank = self.running.pop(ref)
            value = self.actors.get(ref, "generate", self.replicas[replica][rank])
            if rank == 0:  # the replica's rank 0 speaks for it
                lo = self.chunks[c][0]
                self.results[c] = [dataclasses.replace(x, prompt_index=x.prompt_index + lo) for x in value]
            self.left[c] -= 1
            if self.left[c] == 0:
                self.last_progress = time.monotonic()
                self._send(replica)

    def done(self) -> bool:
        if self.running:
            self._step(0)
        return not self.running

    def result(self) -> list[Completion]:
        while self.running:
            remaining = self.last_progress + self.actors.timeout_s - time.monotonic()
            if remaining <= 0:
                slots = sorted({self.replicas[r][rank] for r, _, rank in self.running.values()})
                raise self.actors.late(slots, "generate")
            self._step(max(remaining, 0))
        out = [x for chunk in self.results for x in chunk or []]
        return sorted(out, key=lambda x: (x.prompt_index, x.sample_index))
