"""`run_sft(cfg)`: supervised fine-tuning (`rlloom sft`), on the training engine that RL trains.

check the rows and the model -> build the training group (no rollout, no weight sync) -> (resume) ->
[sft_step -> log -> checkpoint every k -> Hugging Face folder every k] -> final checkpoint and
Hugging Face folder -> one summary line, `<run name>: sft_loss_first=... sft_loss_last=... steps=...
seconds=...`.

One step takes `trainer.prompts_per_step` conversations from a seeded order that resumes exactly
(`PromptSource`), and makes one optimizer step of the negative log-likelihood of their assistant
tokens (`rlloom.algorithms.sft`): the engine's micro-batches of `train.max_tokens_per_micro_batch`
tokens, the loss divided by the step's normaliser (`algorithm.agg_mode`: token-mean over the step's
assistant tokens, or seq-mean-token-mean), so micro-batching and the parallel layout never change
it. Checkpoints, resume, logging, Hugging Face folders, LoRA and the parallel layouts are RL's own
(`trainer/checkpoint.py`, `trainer/export.py`, the `train` and `parallel` sections); `rlloom export`
reads an SFT run like any other, and `rlloom train` starts from its folder with
`model.path=RUN_DIR/hf/step_N`.

Settings of RL alone (rollout, reward, the policy loss) are not read, except that a KL reference
(algorithm.kl_coef > 0) or a critic (algorithm.estimator=gae) would build models the fine-tune never
uses, and are refused.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from rlloom.algorithms.sft import SFT_AGG_MODES, sft_normalizer
from rlloom.cluster.base import TrainGroup
from rlloom.cluster.build import build_train_group
from rlloom.config import ConfigError, RunConfig
from rlloom.config.loading import to_dict
from rlloom.data.conversations import Conversation
from rlloom.data.dataset import DataError
from rlloom.data.source import PromptSource
from rlloom.data.types import RolloutBatch, Sample
from rlloom.engines.train.build import check_parallel
from rlloom.faults import check_fault_env, maybe_fail
from rlloom.heap import freeze_heap
from rlloom.models import load_tokenizer
from rlloom.observability.log import init_logger
from rlloom.observability.loggers import build_loggers, run_name
from rlloom.observability.metrics import MetricsAccumulator
from rlloom.observability.timers import StageTimer
from rlloom.trainer.checkpoint import TrainerState, load_checkpoint, prepare_run_dir, resolve_resume
from rlloom.trainer.loop import LoopParts, StepHooks, run_steps
from rlloom.trainer.model_folder import check_tokenizer
from rlloom.trainer.preflight import (
    check_logging_backends,
    check_policy_model,
    check_resume_config,
    model_hf_config,
)
from rlloom.trainer.run import start_run_dir
from rlloom.trainer.run_lock import RunDirLock
from rlloom.trainer.sft_data import conversation_samples, sft_conversations
from rlloom.trainer.stop import StopSignals

Row = list[Sample]
"""One conversation's samples (one, or one per run of turns the template extends)."""


@dataclass(kw_only=True, slots=True)
class SFTResult:
    steps: int
    seconds: float
    loss_first: float | None
    """sft/loss of the first step this process trained (None when it trained none)."""
    loss_last: float | None
    run_dir: Path


def run_sft(cfg: RunConfig) -> SFTResult:
    """Fine-tune under an exclusive lock on `trainer.run_dir`, after the start-up checks (the rows
    and the model folder are checked before anything heavy loads); a resume must continue the same run."""
    init_logger()
    check_fault_env()
    with RunDirLock(cfg.trainer.run_dir):
        prepare_run_dir(cfg.trainer.run_dir)
        resume_from = resolve_resume(cfg)
        if resume_from is not None:
            check_resume_config(resume_from, cfg)
        conversations = check_sft_before_loading(cfg)
        return _run_sft(cfg, conversations, resume_from)


def check_sft_before_loading(cfg: RunConfig) -> list[Conversation]:
    """The settings, the rows and the model folder, each problem one `ConfigError` / `DataError` line;
    returns the checked rows."""
    algo = cfg.algorithm
    if algo.agg_mode not in SFT_AGG_MODES:
        raise ConfigError(
            f"algorithm.agg_mode={algo.agg_mode} is invalid for rlloom sft: the loss is a mean NLL, over the "
            f"step's assistant tokens or per row. Fix: set algorithm.agg_mode to one of {', '.join(SFT_AGG_MODES)}."
        )
    if algo.kl_coef > 0:
        raise ConfigError(
            f"algorithm.kl_coef={algo.kl_coef:g} is invalid for rlloom sft: it has no KL term, and the reference "
            "model would be built for nothing. Fix: set algorithm.kl_coef=0."
        )
    if algo.uses_critic:
        raise ConfigError(
            "algorithm.estimator=gae is invalid for rlloom sft: it trains no critic. Fix: leave "
            "algorithm.estimator at its default."
        )
    conversations = sft_conversations(cfg.data)
    hf_config = model_hf_config(cfg.model.path)
    check_tokenizer(cfg.model.path, "model.path", chat_template=True, system_prompt=cfg.data.system_prompt)
    check_policy_model(cfg, hf_config)
    check_parallel(cfg, hf_config)
    check_logging_backends(cfg)
    return conversations


def tokenize_rows(cfg: RunConfig, conversations: list[Conversation], tokenizer: object) -> list[Row]:
    """Each conversation's samples; DataError for one longer than the model's positions."""
    rows = [
        conversation_samples(tokenizer, c, system_prompt=cfg.data.system_prompt, group_id=i)
        for i, c in enumerate(conversations)
    ]
    max_positions = model_hf_config(cfg.model.path).get("max_position_embeddings")
    if isinstance(max_positions, int):
        for conversation, row in zip(conversations, rows):
            longest = max((s.num_tokens for s in row), default=0)
            if longest > max_positions:
                raise DataError(
                    f"data.path={cfg.data.path!r} line {conversation.line}: the conversation is {longest} tokens, "
                    f"beyond the model's max_position_embeddings={max_positions} ({cfg.model.path}). Fix: shorten "
                    "or remove the row."
                )
    return rows


def sft_step(train: TrainGroup, source: PromptSource[Row], cfg: RunConfig) -> dict[str, float]:
    """One optimizer step on the next `trainer.prompts_per_step` conversations."""
    timer = StageTimer()
    batch = RolloutBatch([s for row in source.next_batch(cfg.trainer.prompts_per_step) for s in row])
    normalizer = sft_normalizer(batch.response_mask(), cfg.algorithm.agg_mode)
    acc = MetricsAccumulator()
    with timer("train"):
        acc.add(train.update_sft(batch, normalizer).result())
    metrics = acc.summary()
    seconds = timer.seconds()
    metrics.update(seconds)
    metrics["time/step_s"] = sum(seconds.values())
    metrics["perf/tokens"] = float(batch.num_tokens)
    metrics["perf/step_tok_per_s"] = batch.num_tokens / max(metrics["time/step_s"], 1e-9)
    metrics["policy/version"] = float(train.version)
    return metrics


def _run_sft(cfg: RunConfig, conversations: list[Conversation], resume_from: Path | None) -> SFTResult:
    start = time.perf_counter()
    run_dir = start_run_dir(cfg)
    log = init_logger()

    phase = time.perf_counter()
    rows = tokenize_rows(cfg, conversations, load_tokenizer(cfg.model.path))
    source = PromptSource(rows, seed=cfg.data.seed)
    num_trained = sum(m for row in rows for s in row for m in s.response_loss_mask())
    log.info(
        "start-up: tokenizer and data %.1f s (%d conversations, %d assistant tokens)",
        time.perf_counter() - phase,
        len(rows),
        num_trained,
    )
    phase = time.perf_counter()
    train = build_train_group(cfg)
    log.info("start-up: model and engine %.1f s (%s)", time.perf_counter() - phase, cfg.model.path)

    state = TrainerState(step=0, data_state=source.state_dict())
    if resume_from is not None:
        state = load_checkpoint(train, None, resume_from)
        source.load_state_dict(state.data_state)
        log.info("resumed from %s at step %d", resume_from, state.step)
    loggers = build_loggers(
        cfg.logging,
        run_dir,
        resume_from_step=state.step + 1 if resume_from else None,
        total_steps=cfg.trainer.total_steps,
        config=to_dict(cfg),
    )

    losses: list[float] = []

    def step(done: int, _: StopSignals) -> dict[str, float]:
        metrics = sft_step(train, source, cfg)
        maybe_fail("train", done)
        return metrics

    def keep_loss(step: int, metrics: dict[str, float], _: bool) -> None:
        losses.append(metrics["sft/loss"])
        _warn_if_skipped(metrics, step)

    def freeze() -> None:
        freeze_heap()
        train.freeze_heap().result()

    try:  # trainer/loop.py: checkpoints, Ctrl-C / SIGTERM, logging, as RL's
        run_steps(LoopParts(cfg, state, train, source, loggers), step, StepHooks(freeze, keep_loss))
    finally:
        loggers.close()
        train.close()
    seconds = time.perf_counter() - start
    result = SFTResult(
        steps=state.step,
        seconds=seconds,
        loss_first=losses[0] if losses else None,
        loss_last=losses[-1] if losses else None,
        run_dir=run_dir,
    )
    print(
        f"{run_name(cfg.logging, run_dir)}: sft_loss_first={_fmt(result.loss_first)} "
        f"sft_loss_last={_fmt(result.loss_last)} steps={result.steps} seconds={seconds:.0f}",
        flush=True,
    )
    return result


def _warn_if_skipped(metrics: dict[str, float], step: int) -> None:
    if metrics.get("train/skipped_step", 0.0) > 0:
        init_logger().warning(
            "step %d: its optimizer step was skipped because the loss, the gradient norm or the new "
            "parameters were not finite; the parameters and the optimizer state did not change",
            step,
        )


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"
