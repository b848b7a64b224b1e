"""The asynchronous loop's producer in this process (cluster.mode=inline): generation on the
rollout engine's step-level API (`add_request` / `step` / `abort` / `resume_request`) in a
background thread, kept in flight while the controller trains.

Each decode step runs under the stream's lock; the controller takes the lock only between two steps
(admitting jobs, taking a complete one, changing the weights), so generation overlaps training and
the weights change between decode steps without draining (in-flight updates). Continuous batching
runs every admitted job together: when the oldest is complete, younger ones are part-generated.
Jobs and groups: rollout_jobs.py.

New weights arrive between decode steps (`update_weights`); `rollout.partial` decides what happens
to the requests in flight:
- finish: they run to the end under the old weights first, then the weights change;
- abort_resume: they are aborted, the weights change, and each sample resumes from prompt + its
  tokens so far (the KV cache rebuilt by a prefill under the new weights); every token keeps the
  version and the logprob of the policy that produced it (`Sample.token_versions`);
- drop: their tokens are discarded and the samples start again under the new weights.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from rlloom.config.components import RunConfig
from rlloom.data.dataset import PromptItem
from rlloom.data.source import PromptSource
from rlloom.data.types import Sample
from rlloom.engines.rollout import Completion, SamplingParams
from rlloom.rewards.runner import RewardRunner
from rlloom.trainer.rollout_jobs import ROUND_STRIDE, Job, add_group, group_id, make_sample, round_sampling


@dataclass(kw_only=True, slots=True)
class _Request:
    """One prompt of a job in flight: its samples as they complete, and the tokens of aborted ones."""

    job: Job
    item: PromptItem
    sampling: SamplingParams
    position: int
    """The prompt's position in its round (the engine's prompt index)."""
    group_id: int
    order: int
    done: dict[int, Sample] = field(default_factory=dict)
    partial: dict[int, tuple[list[int], list[float], list[int]]] = field(default_factory=dict)
    """sample index -> (tokens, logprobs, token versions) kept from an abort."""


class RolloutStream:
    """The producer side of the asynchronous loop, on one in-process rollout engine."""

    def __init__(
        self,
        engine: Any,
        cfg: RunConfig,
        *,
        source: PromptSource,
        runner: RewardRunner,
        decode: Callable[[list[int]], str],
        stop_token_ids: list[int],
    ) -> None:
        self.engine, self.cfg, self.source = engine, cfg, source
        self.runner, self.decode, self.stop_token_ids = runner, decode, stop_token_ids
        self.jobs: list[Job] = []
        """Jobs admitted and not yet taken, oldest first."""
        self.requests: dict[str, _Request] = {}
        self.tokens_discarded = 0
        """Tokens thrown away by `partial=drop` (and by `drop_all`)."""
        self._aborting = False
        """True while the completions of our own abort come out (not a rejected request)."""
        self.busy_s = 0.0
        """Seconds spent in decode steps (the rollout's busy time)."""
        self._cond = threading.Condition()
        """Held by every change to the stream and by each decode step: weights change between steps."""
        self._pause = False
        """The controller wants the stream: the generation thread waits before its next step."""
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._awaited: Callable[[], bool] | None = None
        self._reached = threading.Event()

    # ---- admission -------------------------------------------------------------------------------

    def submit(self, index: int) -> Job:
        """Admit the job of batch `index`: draw its prompts and add their requests (generated once
        `start` is called)."""
        with self._held():
            job = Job(index=index, data_state=self.source.state_dict())
            self.jobs.append(job)
            self._add_round(job, self.cfg.trainer.prompts_per_step)
        return job

    def start(self) -> None:
        """Start the generation thread on what is in flight (it stops when nothing is)."""
        with self._held():
            self._start()

    def _add_round(self, job: Job, num_prompts: int) -> None:
        items = self.source.next_batch(num_prompts)
        sampling = round_sampling(self.cfg, job, len(items), self.stop_token_ids)
        for i, (item, params) in enumerate(zip(items, sampling)):
            request_id = f"{job.index}:{job.rounds}:{i}"
            self.requests[request_id] = _Request(
                job=job,
                item=item,
                sampling=params,
                position=i,
                group_id=group_id(job, job.rounds, i),
                order=job.rounds * ROUND_STRIDE + i,
            )
            self.engine.add_request(item.prompt_ids, params, request_id=request_id, prompt_index=i)
        job.outstanding += len(items)
        job.rounds += 1

    # ---- generation ------------------------------------------------------------------------------

    def is_complete(self, job: Job) -> bool:
        """All its prompts are done and it needs (or may draw) no more rounds."""
        return job.is_complete(self.cfg)

    def wait_until(self, done: Callable[[], bool]) -> None:
        """Block until `done()` holds (the generation thread checks it after each decode step)."""
        with self._held():
            self._raise()
            if done():
                return
            if self._thread is None:
                raise RuntimeError("rollout stream: nothing in flight but the awaited jobs are not complete")
            self._awaited = done
            self._reached.clear()
        self._reached.wait()
        with self._held():
            self._raise()
            if not done():
                raise RuntimeError("rollout stream: nothing in flight but the awaited jobs are not complete")

    @contextmanager
    def _held(self) -> Iterator[None]:
        """Hold the stream between two decode steps (the generation thread waits meanwhile)."""
        self._pause = True
        with self._cond:
            try:
                yield
            finally:
                self._pause = False
                self._cond.notify_all()

    def _start(self) -> None:
        """Start the generation thread unless it runs (call holding the stream)."""
        if self._thread is None and self.engine.has_unfinished():
            self._thread = threading.Thread(target=self._generate, name="rollout-stream", daemon=True)
            self._thread.start()

    def _generate(self) -> None:
        """The generation thread: one decode step at a time under the lock until nothing is in flight;
        between steps the controller may take the stream (and change the weights)."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: not self._pause)
                try:
                    if not self.engine.has_unfinished():
                        self._stop()
                        return
                    start = time.perf_counter()
                    self._record(self.engine.step())
                    for job in self.jobs:  # dynamic sampling: the next round once a round is done
                        if job.needs_round(self.cfg):
                            self._add_round(job, job.missing(self.cfg))
                    self.busy_s += time.perf_counter() - start
                    if self._awaited is not None and self._awaited():
                        self._awaited = None
                        self._reached.set()
                except BaseException as e:  # noqa: BLE001 - re-raised in the controller's thread
                    self._error = e
                    self._stop()
                    return

    def _stop(self) -> None:
        self._thread, self._awaited = None, None
        self._reached.set()

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _record(self, completions: list[Completion]) -> None:
        for c in completions:
            request = self.requests[c.request_id]
            if c.finish_reason == "abort" and not self._aborting:
                raise ValueError(f"rollout rejected prompt {request.item.index}: {c.error}")
            if c.finish_reason == "abort":  # aborted by update_weights: resumed or restarted there
                request.partial[c.sample_index] = _merge(request, c)
                continue
            request.done[c.sample_index] = self._sample(request, c)
            if len(request.done) == request.sampling.n:
                self._finish_request(c.request_id, request)

    def _sample(self, request: _Request, c: Completion) -> Sample:
        _, _, versions = request.partial.pop(c.sample_index, ([], [], []))
        return make_sample(request.item, request.group_id, c, _versions(versions, c))

    def _finish_request(self, request_id: str, request: _Request) -> None:
        del self.requests[request_id]
        group = [request.done[j] for j in range(request.sampling.n)]
        add_group(request.job, group, request.order, self.cfg, self.runner, self.decode)

    # ---- weights ---------------------------------------------------------------------------------

    def update_weights(self, sync: Callable[[], dict[str, float]]) -> dict[str, float]:
        """Apply `sync` (which moves the new weights into this engine) between two decode steps,
        treating the requests in flight as `rollout.partial` says; return the sync's metrics and
        async/tokens_interrupted (tokens of aborted requests, resumed or discarded)."""
        mode = self.cfg.rollout.partial
        if mode == "finish":
            self.wait_until(lambda: not self.requests)
        with self._held():
            self._raise()
            interrupted = self._abort_all() if mode != "finish" else 0
            metrics = dict(sync())
            for request_id, request in self.requests.items():
                for j, (tokens, logprobs, versions) in sorted(request.partial.items()):
                    if mode == "drop":
                        self.tokens_discarded += len(tokens)
                        tokens, logprobs, versions = [], [], []
                        request.partial[j] = (tokens, logprobs, versions)
                    self.engine.resume_request(
                        request.item.prompt_ids,
                        request.sampling,
                        output_ids=tokens,
                        logprobs=logprobs,
                        request_id=request_id,
                        prompt_index=request.position,
                        sample_index=j,
                    )
            self._start()
        metrics["async/tokens_interrupted"] = float(interrupted)
        return metrics

    def _abort_all(self) -> int:
        """Abort every request in flight, keeping each sample's tokens in `partial`; return their count."""
        if not self.requests:
            return 0
        self._aborting = True
        self.engine.abort(list(self.requests))
        self._record(self.engine.step())  # nothing else is scheduled: only the aborted come out
        self._aborting = False
        return sum(len(p[0]) for r in self.requests.values() for p in r.partial.values())

    def admitted(self) -> list[Job]:
        """The jobs admitted and not yet taken, oldest first."""
        with self._held():
            return list(self.jobs)

    def take(self) -> Job:
        """Remove and return the oldest job (complete)."""
        with self._held():
            self._raise()
            job = self.jobs.pop(0)
        assert self.is_complete(job), f"job {job.index} taken while {job.outstanding} prompts are in flight"
        return job

    def drop_all(self) -> dict[str, Any] | None:
        """Abort every request and forget every job; return the prompt-source position of the oldest
        dropped job (to draw its prompts again), or None when nothing was admitted."""
        with self._held():
            self._raise()
            self.tokens_discarded += self._abort_all()
            self.requests.clear()
            oldest = self.jobs[0].data_state if self.jobs else None
            self.jobs.clear()
        return oldest


def _versions(before: list[int], c: Completion) -> list[int]:
    """Per-token versions of a completion that resumed from `len(before)` tokens of known versions
    (the completion repeats those tokens; the ones after carry its own version)."""
    return before + [c.policy_version] * (len(c.token_ids) - len(before))


def _merge(request: _Request, c: Completion) -> tuple[list[int], list[float], list[int]]:
    """An aborted sample's tokens, logprobs and per-token versions so far."""
    _, _, versions = request.partial.pop(c.sample_index, ([], [], []))
    return list(c.token_ids), list(c.logprobs), _versions(versions, c)
