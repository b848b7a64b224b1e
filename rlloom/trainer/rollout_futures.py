"""The asynchronous loop's producer on a rollout group's `generate` futures (cluster.mode=ray): each
round of a job is one `rollout_group.generate` call, in flight on the rollout replicas while the
controller trains. With cluster.placement=separate the replicas have their own GPUs, so the next
batch generates while this one trains (one_step_off, async).

Used for rollout.partial=finish on Ray (any rollout.tp): weights change only when nothing is in
flight (`update_weights` first waits for every round submitted, generated under the old weights).
abort_resume and drop go through the rollout actors' step-level producers (rollout_stream.py). The
futures are polled only while the controller waits on generation, so with several
replicas a round's later chunks are handed out then (`QueuedGeneration`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlloom.cluster.base import Pending, RolloutGroup
from rlloom.config.components import RunConfig
from rlloom.data.dataset import PromptItem
from rlloom.data.source import PromptSource
from rlloom.engines.rollout import Completion
from rlloom.rewards.runner import RewardRunner
from rlloom.trainer.rollout_jobs import ROUND_STRIDE, Job, add_group, group_id, make_sample, round_sampling


class FutureStream:
    """Jobs in flight as `generate` futures; the same methods as `RolloutStream`."""

    def __init__(
        self,
        rollout_group: RolloutGroup,
        cfg: RunConfig,
        *,
        source: PromptSource,
        runner: RewardRunner,
        decode: Callable[[list[int]], str],
        stop_token_ids: list[int],
    ) -> None:
        self.group, self.cfg, self.source = rollout_group, cfg, source
        self.runner, self.decode, self.stop_token_ids = runner, decode, stop_token_ids
        self.jobs: list[Job] = []
        self.rounds: list[tuple[Job, int, list[PromptItem], Pending[list[Completion]]]] = []
        """Rounds submitted and not collected: (job, round, prompts, future), oldest first."""
        self.tokens_discarded = 0
        self.busy_s: float | None = None
        """Not measured: `generate` calls report no busy time."""

    def submit(self, index: int) -> Job:
        job = Job(index=index, data_state=self.source.state_dict())
        self.jobs.append(job)
        self._add_round(job, self.cfg.trainer.prompts_per_step)
        return job

    def _add_round(self, job: Job, num_prompts: int) -> None:
        items = self.source.next_batch(num_prompts)
        sampling = round_sampling(self.cfg, job, len(items), self.stop_token_ids)
        future = self.group.generate([it.prompt_ids for it in items], sampling)
        self.rounds.append((job, job.rounds, items, future))
        job.outstanding += len(items)
        job.rounds += 1

    def start(self) -> None:
        """The futures run from submission."""

    def admitted(self) -> list[Job]:
        return list(self.jobs)

    def is_complete(self, job: Job) -> bool:
        return job.is_complete(self.cfg)

    def wait_until(self, done: Callable[[], bool]) -> None:
        """Collect rounds, oldest first (starting dynamic sampling's extra rounds), until `done()`."""
        while not done():
            if not self.rounds:
                raise RuntimeError("rollout futures: nothing in flight but the awaited jobs are not complete")
            for *_, future in self.rounds:
                future.done()  # hands the next chunks to idle replicas
            job, round_idx, items, future = self.rounds.pop(0)
            self._collect(job, round_idx, items, future.result())
            for j in self.jobs:
                if j.needs_round(self.cfg):
                    self._add_round(j, j.missing(self.cfg))

    def _collect(
        self, job: Job, round_idx: int, items: list[PromptItem], completions: list[Completion]
    ) -> None:
        by_prompt: dict[int, list[Completion]] = {}
        for c in completions:
            if c.error is not None:
                raise ValueError(f"rollout rejected prompt {c.prompt_index}: {c.error}")
            by_prompt.setdefault(c.prompt_index, []).append(c)
        for i, item in enumerate(items):
            gid = group_id(job, round_idx, i)
            group = [
                make_sample(item, gid, c, [c.policy_version] * len(c.token_ids))
                for c in sorted(by_prompt[i], key=lambda c: c.sample_index)
            ]
            add_group(job, group, round_idx * ROUND_STRIDE + i, self.cfg, self.runner, self.decode)

    def update_weights(self, sync: Callable[[], dict[str, float]]) -> dict[str, float]:
        """The sync once every submitted round is collected (generated under the old weights)."""
        self.wait_until(lambda: not self.rounds)
        return {**sync(), "async/tokens_interrupted": 0.0}

    def take(self) -> Job:
        job = self.jobs.pop(0)
        assert self.is_complete(job), f"job {job.index} taken while {job.outstanding} prompts are in flight"
        return job

    def drop_all(self) -> dict[str, Any] | None:
        """Wait out the rounds in flight (a remote generation cannot be cancelled), discard them and
        forget every job; return the prompt-source position of the oldest dropped job."""
        for *_, future in self.rounds:
            self.tokens_discarded += sum(len(c.token_ids) for c in future.result())
        self.rounds.clear()
        oldest = self.jobs[0].data_state if self.jobs else None
        self.jobs.clear()
        return oldest
