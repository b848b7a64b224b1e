"""`run(cfg)`: the whole training job, reading like the algorithm (STYLE.md §3).

build -> (resume) -> evaluate -> [rl_step -> log -> evaluate every k -> checkpoint every k -> Hugging
Face folder every k] -> final evaluation, checkpoint and Hugging Face folder -> one summary line,
`<run name>: accuracy_before=... accuracy_after=... steps=... seconds=...`. The start-up phases
(tokenizer and data, model and engines, first generated token, first evaluation) are logged with
their times; the first generated token's, counted from process start, is also the metric
`perf/first_token_s` of the first step this process trains (observability/startup.py).

A worker that fails for good (`WorkerFailure`: a training actor, or a rollout replica the rollout
group could not replace) restarts the run in this process, up to `trainer.max_restarts` times:
the groups are torn down and built again, the newest checkpoint is loaded (none: from the start)
and the run goes on, exactly as `trainer.resume=auto` would continue it. One line says why (the
failure names the rank, its node and the stage); `cluster/train_restarts` counts them. When the
cluster's alive nodes no longer have room for the layout (`NoRoom`: a node was lost), the run stops
at once with one line naming the failure, the lost nodes and how to continue.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlloom.agents.build import build_agent_driver
from rlloom.cluster import NoRoom, WorkerFailure
from rlloom.cluster.build import Groups, build_groups, cluster_session
from rlloom.config import RunConfig
from rlloom.config.loading import to_dict, to_yaml
from rlloom.data.control_tokens import ResponseDecoder
from rlloom.data.dataset import PromptItem
from rlloom.data.source import PromptSource
from rlloom.data.types import Sample
from rlloom.determinism import enable_determinism, timing_caveat
from rlloom.episodes.build import build_episode_driver
from rlloom.faults import check_fault_env
from rlloom.models import load_tokenizer
from rlloom.models.checkpoint import load_image_processing
from rlloom.observability.log import init_logger
from rlloom.observability.loggers import MultiLogger, build_loggers, run_name
from rlloom.observability.samples import pick_samples, sample_records
from rlloom.observability.startup import first_token_s
from rlloom.plan.check import check_fits
from rlloom.rewards.build import build_reward_runner
from rlloom.rewards.runner import RewardRunner
from rlloom.run_files import write_text
from rlloom.tasks.build import build_task_source
from rlloom.trainer.async_loop import AsyncLoop
from rlloom.trainer.checkpoint import (
    CONFIG_FILE,
    TrainerState,
    folder_gb,
    load_checkpoint,
    prepare_run_dir,
    resolve_resume,
)
from rlloom.trainer.evaluate import evaluate
from rlloom.trainer.loop import LoopParts, StepHooks, due, run_steps
from rlloom.trainer.preflight import check_before_loading, check_resume_config, fit_multi_turn_budget
from rlloom.trainer.run_lock import RunDirLock
from rlloom.trainer.step import StepContext, rl_step, update_was_skipped
from rlloom.trainer.stop import StopSignals

log = logging.getLogger(__name__)


class TrainingStalled(RuntimeError):
    """Every policy update of the run was skipped (non-finite loss, gradient or new parameters)."""


@dataclass(kw_only=True, slots=True)
class RunResult:
    steps: int
    seconds: float
    accuracy_before: float | None
    accuracy_after: float | None
    run_dir: Path


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def run(cfg: RunConfig) -> RunResult:
    """Train under an exclusive lock on `trainer.run_dir` (a second run there is refused), after the
    start-up checks; a resume must continue the same run (see `check_resume_config`)."""
    init_logger()
    check_fault_env()
    enable_determinism(cfg.trainer.deterministic)  # before anything runs on a GPU (cuBLAS's setting)
    cfg = fit_multi_turn_budget(cfg)
    with RunDirLock(cfg.trainer.run_dir):
        prepare_run_dir(cfg.trainer.run_dir)
        resume_from = resolve_resume(cfg)
        if resume_from is not None:
            check_resume_config(resume_from, cfg)
        check_before_loading(cfg)
        with cluster_session(cfg):  # one Ray for every attempt: a restart replaces the actors
            return _run_restarting(cfg, resume_from)


def _run_restarting(cfg: RunConfig, resume_from: Path | None) -> RunResult:
    """The run from `resume_from`, started again from its newest checkpoint after each
    `WorkerFailure`, up to `trainer.max_restarts` times."""
    restarts, cause = 0, None
    while True:
        try:
            return _run(cfg, resume_from, restarts)
        except WorkerFailure as e:
            if restarts >= cfg.trainer.max_restarts or isinstance(e, NoRoom):
                lost = f"{str(cause).rstrip('.')}, and {e}" if isinstance(e, NoRoom) and cause else str(e)
                raise WorkerFailure(f"{lost.rstrip('.')}. {_stopped(cfg, restarts)}") from e
            restarts, cause = restarts + 1, e
            resume_from = newest_checkpoint(cfg)
            log.warning(
                "training restart %d of trainer.max_restarts=%d: %s; the groups start again from %s",
                restarts,
                cfg.trainer.max_restarts,
                e,
                resume_from or "the beginning (no checkpoint yet)",
            )


def newest_checkpoint(cfg: RunConfig) -> Path | None:
    """The checkpoint `trainer.resume=auto` would continue from (None: there is none yet)."""
    return resolve_resume(dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, resume="auto")))


def _stopped(cfg: RunConfig, restarts: int) -> str:
    used = f" after {restarts} restarts (trainer.max_restarts={cfg.trainer.max_restarts})" if restarts else ""
    return f"The run stopped{used}; restart with trainer.resume=auto to continue from the last checkpoint."


def start_run_dir(cfg: RunConfig) -> Path:
    """Logging, seeds, and the run directory with the run's config in it."""
    init_logger()
    seed_everything(cfg.trainer.seed)
    run_dir = Path(cfg.trainer.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text(run_dir / CONFIG_FILE, to_yaml(cfg))
    return run_dir


def _build_groups_or_close(cfg: RunConfig, runner: RewardRunner) -> Groups:
    """The run's groups; a start that fails closes the reward runner first (its worker processes
    must not outlive it, nor pile up over restarts)."""
    try:
        return _build_groups(cfg)
    except BaseException:
        runner.close()
        raise


def _run(cfg: RunConfig, resume_from: Path | None, restarts: int = 0) -> RunResult:
    """The run from `resume_from` (None: the start); `restarts`: the training restarts before it."""
    start = time.perf_counter()
    run_dir = start_run_dir(cfg)
    data = _load_data(cfg)
    source, eval_items, runner, decode = data.source, data.eval_items, data.runner, data.decode
    groups = _build_groups_or_close(cfg, runner)
    picked: list[Sample] = []

    def keep_samples(samples: list[Sample]) -> None:  # the few of each step's samples that are logged
        picked[:] = pick_samples(samples, cfg.logging.samples_per_step)

    ctx = _step_context(cfg, groups, data, keep_samples)

    state = TrainerState(step=0, data_state=source.state_dict())
    if resume_from is not None:
        state = _resume(cfg, ctx, groups, resume_from)
    loggers = build_loggers(
        cfg.logging,
        run_dir,
        resume_from_step=state.step + 1 if resume_from else None,
        total_steps=cfg.trainer.total_steps,
        config=to_dict(cfg),
    )

    run_eval = lambda: evaluate(
        groups.rollout, eval_items, runner, decode, cfg, stop_token_ids=data.stop_token_ids
    )
    steps = _RLSteps(
        ctx=ctx, state=state, groups=groups, loggers=loggers, run_eval=run_eval if eval_items else None,
        picked=picked, restarts=restarts, first_step=state.step + 1,
    )  # fmt: skip
    try:
        if state.step == 0 and state.accuracy_before is None and eval_items:
            before = _first_evaluation(run_eval, len(eval_items))
            state.accuracy_before = before["eval/accuracy"]
            loggers.log(0, before)
        steps.loop = AsyncLoop(ctx) if cfg.trainer.mode != "sync" else None  # trainer/async_loop.py
        parts = LoopParts(cfg, state, groups.train, source, loggers, groups.critic)
        saved = run_steps(parts, steps.step, steps.hooks())  # trainer/loop.py
    finally:
        for part in (loggers, runner, ctx.episodes, groups):
            if part is not None:
                part.close()
    return _summary(cfg, run_dir, state, steps.after.get("eval/accuracy"), saved, time.perf_counter() - start)


@dataclass(frozen=True, slots=True)
class _Data:
    """What the run reads before it builds any engine: prompts, tokenizer, rewards."""

    tokenizer: Any
    source: PromptSource
    eval_items: list[PromptItem]
    runner: RewardRunner
    decode: ResponseDecoder
    """Control tokens inside a response stay visible."""
    stop_token_ids: list[int]
    """The tokenizer's EOS (evaluation stops there; training too unless rollout.ignore_eos)."""


def _load_data(cfg: RunConfig) -> _Data:
    """The tokenizer, the training and evaluation prompts and their reward (a start-up phase, logged)."""
    phase = time.perf_counter()
    tokenizer = load_tokenizer(cfg.model.path)
    images = load_image_processing(cfg.model.path)
    source = build_task_source(cfg.data, tokenizer, "train", images)
    eval_items = list(build_task_source(cfg.data, tokenizer, "eval", images).items)
    log.info(
        "start-up: tokenizer and data %.1f s (%d train, %d eval prompts)",
        time.perf_counter() - phase,
        len(source),
        len(eval_items),
    )
    columns = {name for item in (*source.items, *eval_items) for name in item.metadata}
    return _Data(
        tokenizer=tokenizer,
        source=source,
        eval_items=eval_items,
        runner=build_reward_runner(cfg.reward, task=cfg.data.task, columns=columns),
        decode=ResponseDecoder.of(tokenizer),
        stop_token_ids=[tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [],
    )


def _build_groups(cfg: RunConfig) -> Groups:
    """The training and rollout groups, placed as cluster.placement says (a start-up phase, logged),
    after the memory check of `rlloom plan` (docs/plan.md), before any GPU memory is taken."""
    if warning := check_fits(cfg):
        log.warning(warning)
    if warning := timing_caveat(cfg):
        log.warning(warning)
    phase = time.perf_counter()
    groups = build_groups(cfg)
    log.info("start-up: model and engines %.1f s (%s)", time.perf_counter() - phase, cfg.model.path)
    return groups


def _step_context(
    cfg: RunConfig, groups: Groups, data: _Data, on_samples: Callable[[list[Sample]], None]
) -> StepContext:
    return StepContext(
        cfg=cfg,
        train_group=groups.train,
        rollout_group=groups.rollout,
        weight_sync=groups.sync,
        source=data.source,
        runner=data.runner,
        decode=data.decode,
        stop_token_ids=[] if cfg.rollout.ignore_eos else data.stop_token_ids,  # evaluation still stops at EOS
        on_samples=on_samples,
        critic_group=groups.critic,
        episodes=(
            build_agent_driver(cfg, data.tokenizer, data.stop_token_ids)
            if cfg.rollout.agent
            else build_episode_driver(cfg, data.tokenizer, data.stop_token_ids, data.decode)
        ),
    )


@dataclass(kw_only=True, slots=True)
class _RLSteps:
    """RL's step and what it adds to the shared loop (trainer/loop.py): the asynchronous loop, the
    adaptive KL coefficient the checkpoint keeps, restart counts, evaluation every k, the first
    token's time, the logged samples and the stall check."""

    ctx: StepContext
    state: TrainerState
    groups: Groups
    loggers: MultiLogger
    run_eval: Callable[[], dict[str, float]] | None
    """None: the run has no evaluation prompts."""
    picked: list[Sample]
    restarts: int
    first_step: int
    loop: AsyncLoop | None = None
    num_skipped: int = 0
    after: dict[str, float] = field(default_factory=dict)
    """The latest evaluation's metrics."""

    def step(self, step: int, stop: StopSignals) -> dict[str, float]:
        metrics = rl_step(self.ctx, step) if self.loop is None else self.loop.step(step, stop)
        self.state.kl_coef = self.ctx.kl_coef  # the adaptive controller's, for the checkpoint
        self.num_skipped += update_was_skipped(metrics)
        metrics.update(restart_metrics(self.restarts, self.groups.rollout.restarts))
        return metrics

    def add_metrics(self, step: int, metrics: dict[str, float], is_last: bool) -> None:
        if self.run_eval is not None and due(self.ctx.cfg.trainer.eval_every, step, is_last):
            self.after = self.run_eval()
            metrics.update(self.after)
        if step == self.first_step and (seconds := first_token_s()) is not None:
            metrics["perf/first_token_s"] = seconds  # this process's (None in Ray's driver)

    def after_log(self, step: int, is_last: bool) -> None:
        self.loggers.log_samples(step, sample_records(step, self.picked))
        if is_last and self.num_skipped == step - self.first_step + 1:
            raise _stalled(self.ctx.cfg, self.first_step, step)

    def drain(self, step: int) -> None:
        if self.loop is not None:  # a no-op unless the signal came after the step's own check
            self.loop.drain(step)
            self.state.kl_coef = self.ctx.kl_coef

    def hooks(self) -> StepHooks:
        return StepHooks(self.groups.freeze_heap, self.add_metrics, self.after_log, self.drain)


def _resume(cfg: RunConfig, ctx: StepContext, groups: Groups, resume_from: Path) -> TrainerState:
    """The state of the checkpoint `resume_from`, loaded into the groups, the prompt source and (with
    the adaptive KL controller) the step context."""
    state = load_checkpoint(groups.train, groups.sync, resume_from, critic_group=groups.critic)
    ctx.source.load_state_dict(state.data_state)
    if cfg.algorithm.kl_ctrl == "adaptive":
        ctx.kl_coef = state.kl_coef  # the controller goes on where it was
    log.info("resumed from %s at step %d", resume_from, state.step)
    if state.step >= cfg.trainer.total_steps:
        log.warning(
            "the run is already at step %d of trainer.total_steps=%d: nothing to train. To train "
            "further, raise trainer.total_steps.",
            state.step,
            cfg.trainer.total_steps,
        )
    return state


def _first_evaluation(run_eval: Callable[[], dict[str, float]], num_prompts: int) -> dict[str, float]:
    """The evaluation before training (a start-up phase, logged with its time)."""
    phase = time.perf_counter()
    before = run_eval()
    log.info(
        "start-up: first evaluation %.1f s (%d prompts; includes the rollout engine's first-use "
        "set-up: compilation and CUDA graphs where enabled)",
        time.perf_counter() - phase,
        num_prompts,
    )
    return before


def _stalled(cfg: RunConfig, first_step: int, step: int) -> TrainingStalled:
    return TrainingStalled(
        f"every policy update of steps {first_step}-{step} was skipped because the loss, the "
        f"gradient norm or the new parameters were not finite (train.lr={cfg.train.lr:g}); the "
        "weights never changed and no final checkpoint was written. Fix: lower train.lr, or look "
        "for inf/NaN in the rewards and advantages (metrics.jsonl)."
    )


def _summary(
    cfg: RunConfig,
    run_dir: Path,
    state: TrainerState,
    accuracy_after: float | None,
    saved: Path | None,
    seconds: float,
) -> RunResult:
    """The run's result, printed as its one summary line."""
    result = RunResult(
        steps=state.step,
        seconds=seconds,
        accuracy_before=state.accuracy_before,
        accuracy_after=accuracy_after,
        run_dir=run_dir,
    )
    size = (
        "" if saved is None else f" checkpoint_gb={folder_gb(saved):.2f}"
    )  # weights only: see checkpoint.py
    print(
        f"{run_name(cfg.logging, run_dir)}: accuracy_before={_fmt(result.accuracy_before)} accuracy_after={_fmt(result.accuracy_after)} "
        f"steps={result.steps} seconds={seconds:.0f}{size}",
        flush=True,
    )
    return result


def restart_metrics(train_restarts: int, rollout_restarts: int) -> dict[str, float]:
    """The run's restarts so far, logged from the first one on (a run without failures has none)."""
    counts = {"cluster/train_restarts": train_restarts, "cluster/rollout_restarts": rollout_restarts}
    return {k: float(v) for k, v in counts.items() if v}


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"
