"""The group interface the controller talks to: a `TrainGroup` (the training ranks) and a
`RolloutGroup` (the rollout replicas), with PPO's critic a `CriticGroup` on the training ranks, each implemented by `local.py` (one process) and `ray.py`
(actors), placed by `placement.py`.

Every call fans out to the group's workers and returns a `Pending` result at once, so the
controller decides when to wait (`.result()`): a synchronous step waits on each call in turn; the
asynchronous loop keeps a generation in flight while the training group works. `result()` waits at
most `cluster.timeout_s` and raises `WorkerFailure` naming the rank, host and stage of a worker
that died, raised or hung.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch

from rlloom.data.images import ImageInputs
from rlloom.data.types import PolicyUpdate, RolloutBatch, ValueUpdate
from rlloom.engines.rollout import Completion, SamplingParams
from rlloom.observability.metrics import Metric
from rlloom.workers.flights import StreamPartial, StreamRequest, StreamResult

T_co = TypeVar("T_co", covariant=True)
T = TypeVar("T")


class WorkerFailure(RuntimeError):
    """A worker died, raised or hung; the message names its rank, host and stage."""


class NoRoom(WorkerFailure):
    """The Ray cluster's alive nodes cannot hold the run's layout (a node was lost): no restart would
    start, so the run stops and says what to add."""


class Pending(Protocol[T_co]):
    """A result on its way (a Ray object ref, or a value already computed in this process)."""

    def result(self) -> T_co:
        """Block until the result is there (at most `cluster.timeout_s`); raise `WorkerFailure` if a
        worker failed."""
        ...

    def done(self) -> bool:
        """Whether `result()` would return without waiting."""
        ...


@dataclass(frozen=True, slots=True)
class Done(Generic[T]):
    """A `Pending` whose value was computed in this process before it was returned."""

    value: T

    def result(self) -> T:
        return self.value

    def done(self) -> bool:
        return True


class TrainGroup(Protocol):
    """The training ranks (one mesh: pp x dp x cp x tp). Every call goes to every rank with the same
    arguments; results that differ by rank are merged with their declared reduction."""

    @property
    def version(self) -> int:
        """Optimizer steps applied: the policy version of the training weights."""
        ...

    def old_logprobs(self, batch: RolloutBatch) -> Pending[torch.Tensor]: ...

    def ref_logprobs(self, batch: RolloutBatch) -> Pending[torch.Tensor]: ...

    def teacher_logprobs(self, batch: RolloutBatch) -> Pending[torch.Tensor]:
        """[B, T] the distillation teacher's logprobs of the response tokens (teacher.path)."""
        ...

    def update_policy(self, update: PolicyUpdate) -> Pending[dict[str, Metric]]:
        """One optimizer step; its metrics carry their reductions, so the controller can combine the
        steps of several mini-batches (a sum stays a sum, a max a max)."""
        ...

    def update_sft(self, batch: RolloutBatch, normalizer: float) -> Pending[dict[str, Metric]]:
        """One optimizer step of supervised fine-tuning (`rlloom sft`): the NLL of the batch's masked
        tokens over `normalizer` (the whole batch's); its metrics carry their reductions."""
        ...

    def offload(self) -> Pending[None]:
        """Move what the training engines hold on the GPU to the host (colocated placement, before
        the rollout wakes)."""
        ...

    def onload(self) -> Pending[None]: ...

    def save(self, path: str) -> Pending[None]: ...

    def load(self, path: str) -> Pending[None]: ...

    def save_hf(self, path: str) -> Pending[None]: ...

    def freeze_heap(self) -> Pending[None]:
        """`rlloom.heap.freeze_heap` in every process of the group (once, after the first step)."""
        ...

    def close(self) -> None: ...


class CriticGroup(Protocol):
    """PPO's critic (algorithm.estimator=gae): a value model on the training ranks, in their layout.
    Every call goes to every rank with the same arguments; rank 0's result is the group's."""

    def values(self, batch: RolloutBatch) -> Pending[torch.Tensor]:
        """[B, T] values before each response token (CPU, fp32, 0 at masked)."""
        ...

    def update_critic(self, update: ValueUpdate) -> Pending[dict[str, Metric]]:
        """One optimizer step of the value loss; its metrics carry their reductions."""
        ...

    def save(self, path: str) -> Pending[None]: ...

    def load(self, path: str) -> Pending[None]: ...


class RolloutGroup(Protocol):
    """The rollout replicas (each spanning `rollout.tp` ranks)."""

    @property
    def version(self) -> int:
        """The policy version the replicas hold (the last sync's)."""
        ...

    def generate(
        self,
        prompts: list[list[int]],
        sampling: list[SamplingParams],
        images: list[ImageInputs | None] | None = None,
    ) -> Pending[list[Completion]]:
        """Completions of every prompt, in prompt order (`Completion.prompt_index` is the position in
        `prompts`); requests are spread over the replicas by load. `images`: each prompt's pictures
        (a vision-language model)."""
        ...

    num_replicas: int

    restarts: int
    """Replicas replaced after a failure so far (cluster/rollout_restarts; 0 in one process)."""

    def stream_add(self, replica: int, requests: list[StreamRequest]) -> None:
        """Queue requests on replica `replica`'s step-level producer (`workers/stream.py`: one per
        rank, the same calls on each, its rank 0 deciding the step each takes effect at), generated
        in the background from now on (the asynchronous loop)."""
        ...

    def stream_poll(self, timeout_s: float) -> list[StreamResult | StreamPartial]:
        """The samples every replica finished since the last poll (waiting up to `timeout_s`), after
        the tokens so far of unfinished ones whose request asked for them (`StreamRequest.progress`)."""
        ...

    def stream_abort(self) -> int:
        """Abort every request in flight between decode steps (every rank of a replica at the same
        step), keeping tokens, logprobs and versions; returns their token count. Returns once every
        rank's producer is idle: the weights may change afterwards."""
        ...

    def stream_resume(self, keep: bool) -> int:
        """Resume the aborted samples under the current weights, from their tokens (`keep`) or from
        scratch; returns the tokens discarded."""
        ...

    def stream_drop(self) -> int:
        """Abort and forget everything in flight; returns the tokens discarded."""
        ...

    @property
    def stream_busy_s(self) -> float:
        """Seconds the producers spent in decode steps so far (the replicas' mean)."""
        ...

    def sleep(self) -> Pending[None]:
        """Free the KV cache (and with colocated placement the weights' GPU memory) until `wake`."""
        ...

    def wake(self) -> Pending[None]: ...

    def freeze_heap(self) -> Pending[None]:
        """`rlloom.heap.freeze_heap` in every process of the group (once, after the first step)."""
        ...

    def close(self) -> None: ...


class WeightSync(Protocol):
    """Moves the training group's current weights into the rollout group (the transport is
    `weight_sync/build.transport`'s: in place or broadcast). Afterwards every rollout parameter holds the
    training weights under the training version, or, when the sync fails, the rollout keeps its
    previous version and the failure says so."""

    def sync(self) -> dict[str, float]:
        """Blocks until every replica holds the new version; returns the sync metrics (sync/ms,
        sync/gb, sync/ms_per_gb, ...)."""
        ...
