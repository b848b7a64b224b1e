"""The asynchronous modes (`trainer.mode=one_step_off|async`): generation stays in flight while the
policy trains, with a bounded queue and bounded staleness (issue 19).

    admit jobs (one per batch) up to the queue's capacity -> run the rollout until the oldest job is
    complete -> drop (or down-weight) samples older than max_staleness -> train on it (the
    synchronous step's training half) -> new weights into the rollout between decode steps, the
    requests in flight handled as rollout.partial says -> at a checkpoint, evaluation, stop or the
    last step: drop what is in flight and give its prompts back to the source

The queue: at most `capacity(cfg)` jobs are admitted (generating or done, not yet trained): K + 1
for async (max_staleness = K), 2 for one_step_off. That bound is the back-pressure (generation
never runs more than K versions ahead, memory is bounded) and, since a job admitted at version v is
trained at step v + K at the latest, it keeps every sample within the staleness bound; the filter
(`split_stale`) still drops or down-weights any sample beyond it and counts it.

`one_step_off` is async with max_staleness=1 and partial=finish: the job of step k + 1 is admitted
when step k starts and generates while step k trains under version k (the weights synced after step
k - 1); the sync after step k waits for it to finish under those weights. So step k trains on
samples of version k - 1 (k >= 1). `async` admits K + 1 jobs; younger jobs are part-generated when
the oldest completes and meet the weight update in flight. With max_staleness=0 only the job being
trained is admitted: exactly the synchronous run.

The producer: rollout_stream.py drives each rollout replica's step-level producer (workers/stream.py:
a background thread next to the engine, in this process with cluster.mode=inline, in each rollout
actor with Ray, a rollout.tp > 1 replica's ranks following its rank 0's decision at every decode
step; while the controller trains, the stream's pump, stream_pump.py, books the finished samples and
sends multi-turn trajectories' next turns); continuous batching runs every admitted job together,
and all three `rollout.partial` modes work inline and on Ray, colocated or separate, at any
rollout.tp. Real overlap on GPUs needs the
rollout on its own GPUs (cluster.mode=ray, cluster.placement=separate); in one process, or
colocated, the two share them.
With max_staleness=0, or one_step_off, the samples do not depend on thread timing; with
async K >= 1 and abort_resume or drop, where a weight update falls in a response does.

Checkpoints: what is in flight at a checkpoint (scheduled, or written by a Ctrl-C / SIGTERM stop),
an evaluation or the end is dropped and its prompts given back to the source (`drain`), so the next
step generates them again: a resumed run draws exactly the prompts, seeds and versions of the run
that drained there, and no sample is trained twice. The source's cursor never moves back, so a
prompt that dynamic sampling's extra round of an already trained job drew after a dropped job's is
not drawn again in its epoch. The first step after a drain trains on-policy.

Off-policy corrections are on: old logprobs are those of the current weights (the proximal policy:
recomputed by a forward when a step makes several updates, else the training forward's own,
detached) and each token is weighted by proximal / behaviour, the behaviour being the rollout's logprob
of the policy that produced it: truncated (`algorithm.is_correction=tis` unless set), or with
`algorithm.decoupled_ppo` untruncated and masked above `is_high` (AReaL's decoupled PPO).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

from rlloom.config import RunConfig
from rlloom.data.types import Sample
from rlloom.faults import at_stage_end
from rlloom.observability.timers import StageTimer
from rlloom.trainer.rollout import RolloutResult
from rlloom.trainer.rollout_jobs import Job
from rlloom.trainer.rollout_stream import RolloutStream
from rlloom.trainer.step import StepContext, rl_step
from rlloom.trainer.stop import StopSignals


def capacity(cfg: RunConfig) -> int:
    """Jobs admitted at once (generating or complete, not yet trained)."""
    return 2 if cfg.trainer.mode == "one_step_off" else cfg.trainer.max_staleness + 1


def max_staleness(cfg: RunConfig) -> int:
    return 1 if cfg.trainer.mode == "one_step_off" else cfg.trainer.max_staleness


def async_config(cfg: RunConfig) -> RunConfig:
    """The config the training half of the step runs with in the asynchronous modes: off-policy
    correction on, and the rollout never sleeps (its requests stay in flight through training)."""
    algo = cfg.algorithm
    if algo.decoupled_ppo:
        algo = dataclasses.replace(algo, is_correction="mis", is_level="token", is_low=0.0)
    elif algo.is_correction == "none":
        algo = dataclasses.replace(algo, is_correction="tis")
    rollout = dataclasses.replace(cfg.rollout, sleep_during_train=False)
    return dataclasses.replace(cfg, algorithm=algo, rollout=rollout)


def updates_per_step(cfg: RunConfig) -> int:
    """Optimizer steps (policy versions) per RL step."""
    return cfg.trainer.ppo_epochs * cfg.trainer.num_mini_batches


def staleness(cfg: RunConfig, train_version: int, version: int) -> int:
    """RL steps between a policy version and the training weights'."""
    return math.ceil((train_version - version) / updates_per_step(cfg))


def split_stale(
    samples: list[Sample], cfg: RunConfig, train_version: int
) -> tuple[list[Sample], dict[str, float]]:
    """The samples to train at `train_version`: those within max_staleness, plus, with
    stale_samples=downweight, the older ones with loss weight 0.5 ** (staleness - max_staleness);
    and the staleness histogram (async/staleness_k: samples k steps old, by their oldest token)."""
    bound = max_staleness(cfg)
    kept: list[Sample] = []
    versions = [v for s in samples for v in s.response_versions()] or [train_version]
    metrics = {
        "async/samples_dropped": 0.0,
        "async/samples_downweighted": 0.0,
        "async/version_min": float(min(versions)),
        "async/version_max": float(max(versions)),
    }
    for s in samples:
        age = staleness(cfg, train_version, s.oldest_version)
        metrics[f"async/staleness_{age}"] = metrics.get(f"async/staleness_{age}", 0.0) + 1
        if age <= bound:
            kept.append(s)
        elif cfg.trainer.stale_samples == "downweight":
            kept.append(dataclasses.replace(s, loss_weight=s.loss_weight * 0.5 ** (age - bound)))
            metrics["async/samples_downweighted"] += 1
        else:
            metrics["async/samples_dropped"] += 1
    return kept, metrics


def token_staleness(samples: list[Sample], cfg: RunConfig, train_version: int) -> dict[str, float]:
    """async/tokens_staleness_k: response tokens generated k steps before the training weights."""
    out: dict[str, float] = {}
    for s in samples:
        for v in s.response_versions():
            key = f"async/tokens_staleness_{staleness(cfg, train_version, v)}"
            out[key] = out.get(key, 0.0) + 1
    return out


def drains_after(cfg: RunConfig, steps_done: int) -> bool:
    """run.py checkpoints or evaluates after this step, or it is the last: nothing may be in flight."""
    t = cfg.trainer
    return (
        steps_done >= t.total_steps
        or bool(t.save_every and steps_done % t.save_every == 0)
        or bool(t.eval_every and steps_done % t.eval_every == 0)
    )


TRAIN_STAGES = ("old_logprobs", "ref_logprobs", "teacher_logprobs", "advantages", "train")
"""The synchronous step's stages that keep the training group busy."""


class _StreamSync:
    """The weight sync the training half calls, applied between the stream's decode steps."""

    def __init__(self, stream: RolloutStream, sync: Any) -> None:
        self.stream, self.inner = stream, sync

    def sync(self) -> dict[str, float]:
        return self.stream.update_weights(self.inner)


class AsyncLoop:
    """`step(step)` has the synchronous `rl_step`'s contract: train the step, return its metrics."""

    def __init__(self, ctx: StepContext) -> None:
        self.cfg = ctx.cfg
        self.source = ctx.source
        self.stream = ctx.stream
        self.ctx = ctx
        self.next_index: int | None = None
        """Batch index of the next job to admit (None: the first step's)."""

    def step(self, step: int, stop: StopSignals | None = None) -> dict[str, float]:
        """With `stop` given, a signal it recorded during the step drains the queue as a scheduled
        checkpoint does, before the step's metrics are counted (run.py then stops)."""
        cfg, stream = self.cfg, self.stream
        start, busy_before, discarded_before = time.perf_counter(), stream.busy_s, stream.tokens_discarded
        timer = StageTimer(sync_cuda=False, on_end=at_stage_end(step))  # the rollout keeps the GPU busy
        with timer("generate"):
            jobs = self._admit(step)
            stream.wait_until(lambda: stream.is_complete(jobs[0]))
            job = stream.take()

        train_version = self.ctx.train_group.version
        samples, metrics = split_stale(job.batch(cfg), cfg, train_version)
        metrics.update(token_staleness(samples, cfg, train_version))
        metrics.update(job.rollout_metrics())
        rollout = RolloutResult(samples=samples, metrics=dict(metrics))
        # The training half of the synchronous step, with the asynchronous modes' overrides: off-policy
        # correction on and the rollout awake (`async_config`), the new weights applied between the
        # stream's decode steps (`_StreamSync`).
        train_ctx = dataclasses.replace(
            self.ctx, cfg=async_config(cfg), weight_sync=_StreamSync(stream, self.ctx.weight_sync.sync)
        )
        with stream.pumping():  # the stream's next turns, scores and rounds go on while this trains
            metrics.update(rl_step(train_ctx, step, rollout=rollout))
        self.ctx.kl_coef = train_ctx.kl_coef  # the adaptive KL controller's next coefficient
        if drains_after(cfg, step + 1) or (stop is not None and stop.signum is not None):
            self.drain(step + 1)
        total_s = time.perf_counter() - start
        train_s = sum(metrics.get(f"time/{k}_s", 0.0) for k in TRAIN_STAGES)
        metrics.update(
            {
                **timer.seconds(),
                "time/step_s": total_s,
                "perf/step_tok_per_s": metrics.get("perf/tokens", 0.0) / max(total_s, 1e-9),
                "perf/train_idle_frac": max(0.0, 1 - train_s / total_s),
                "async/jobs_admitted": float(len(jobs)),
                "async/tokens_discarded": float(stream.tokens_discarded - discarded_before),
            }
        )
        metrics["perf/rollout_idle_frac"] = max(0.0, 1 - (stream.busy_s - busy_before) / total_s)
        return metrics

    def _admit(self, step: int) -> list[Job]:
        """Admit jobs up to the queue's capacity and start the stream; the jobs admitted, oldest first."""
        cfg, stream = self.cfg, self.stream
        if self.next_index is None:
            self.next_index = step
        while len(stream.admitted()) < capacity(cfg) and self.next_index < cfg.trainer.total_steps:
            stream.submit(self.next_index)
            self.next_index += 1
        stream.start()  # after the admissions: the first decode batch holds every admitted job
        return stream.admitted()

    def drain(self, steps_done: int) -> None:
        """Drop what is in flight and give its prompts back to the source, so that the next step
        admits batch `steps_done` again: before a checkpoint (scheduled, or a stop's), an evaluation
        or the end. The checkpoint then holds a source position no sample was trained past."""
        if dropped := self.stream.drop_all():
            self.source.give_back(dropped)
            self.next_index = steps_done
