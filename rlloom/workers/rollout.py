"""`RolloutWorker`: one rank of a rollout replica. A replica spans `rollout.tp` ranks joined by its
tensor-parallel process group; every rank of a replica is called with the same arguments and rank 0
of the replica's results are the replica's.

The worker holds the weights under a policy version: `update_weights` copies the synced tensors in
place (CUDA graphs stay valid) and later completions carry that version. The asynchronous loop's
requests in flight go through `stream_*` (its `EngineStream`, stream.py): every rank of a replica
gets the same `stream_*` calls, its rank 0 decides at which decode step each takes effect (shared
over `control_group`) and reports the finished samples.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
import torch.distributed as dist

from rlloom.config import RunConfig
from rlloom.data.images import ImageInputs
from rlloom.engines.rollout import Completion, SamplingParams
from rlloom.engines.rollout.build import build_rollout_engine
from rlloom.faults import maybe_fail, reseeds
from rlloom.workers.flights import StreamPartial, StreamRequest, StreamResult
from rlloom.workers.stream import EngineStream


class RolloutWorker:
    """One rollout rank: a rollout engine (or its tensor-parallel part) on one device."""

    def __init__(
        self,
        cfg: RunConfig,
        *,
        device: torch.device,
        dtype: torch.dtype,
        rank: int = 0,
        tp_group: dist.ProcessGroup | None = None,
        control_group: dist.ProcessGroup | None = None,
    ) -> None:
        """`tp_group`: the replica's tensor-parallel group (None at rollout.tp = 1); `control_group`:
        a gloo group of the same ranks for the stream's per-step commands."""
        self.rank = rank
        """Rank among all rollout ranks of the run (for fault injection and error reports)."""
        self.engine = build_rollout_engine(cfg, device=device, dtype=dtype, tp_group=tp_group)
        self.version = 0
        """Policy version of the weights held (the last `update_weights`)."""
        self.stream = EngineStream(self.engine, group=control_group, timeout_s=cfg.cluster.timeout_s)
        """The step-level producer of the asynchronous loop (idle unless `stream_add` is called)."""
        self.reseed = reseeds()
        """A fault for tests: every seeded request draws seed + 1's noise (faults.py)."""

    def generate(
        self,
        prompts: list[list[int]],
        sampling: list[SamplingParams],
        images: list[ImageInputs | None] | None = None,
    ) -> list[Completion]:
        """Completions of every prompt in prompt order (`prompt_index` = position in `prompts`);
        `images`: each prompt's pictures (a vision-language model)."""
        maybe_fail("rollout", self.version, self.rank)
        return self.engine.generate(prompts, sampling, images)

    def stream_add(self, requests: list[StreamRequest]) -> None:
        maybe_fail("rollout", self.version, self.rank)
        if self.reseed:
            requests = [dataclasses.replace(r, sampling=_reseeded(r.sampling)) for r in requests]
        self.stream.add(requests)

    def stream_poll(self, timeout_s: float) -> list[StreamResult | StreamPartial]:
        return self.stream.poll(timeout_s)

    def stream_abort(self) -> int:
        return self.stream.abort()

    def stream_resume(self, keep: bool) -> int:
        return self.stream.resume(keep)

    def stream_drop(self) -> int:
        return self.stream.drop_all()

    def stream_busy(self) -> float:
        """Seconds its producer spent in decode steps so far."""
        return self.stream.busy_s

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy (Hugging Face name, tensor) pairs into the engine in place; later requests carry `version`."""
        self.engine.update_weights(named_tensors, version)
        self.version = version

    def sleep(self) -> None:
        """Free the KV cache until `wake`."""
        self.engine.sleep()

    def wake(self) -> None:
        self.engine.wake()


def _reseeded(sampling: SamplingParams) -> SamplingParams:
    return sampling if sampling.seed is None else dataclasses.replace(sampling, seed=sampling.seed + 1)
