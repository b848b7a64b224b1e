"""One RL step, read straight through: generate -> rewards -> old/ref logprobs (and the critic's
values) -> advantages -> policy (and critic) update -> weight sync. Every stage is timed.

The step drives two groups (`rlloom.cluster.base`): the rollout group generates, the training group
computes logprobs and updates the policy, and the weight sync moves the new weights across. Each
call returns a `Pending`; the step waits on it where the result is needed. The memory handover of
colocated placement is visible here: the rollout sleeps (frees its KV cache) before training and
wakes before the sync. The training group is not offloaded during generation: the rollout engine
sizes its KV cache when it is built, so the memory an offload frees would go unused and the copies
would only cost time (`train_group.offload()/onload()` are there for an engine that sizes its
cache at wake).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlloom.algorithms import loss_normalizer
from rlloom.algorithms.objective import value_normalizer
from rlloom.cluster.base import CriticGroup, RolloutGroup, TrainGroup, WeightSync
from rlloom.config import RunConfig
from rlloom.data.control_tokens import ResponseDecoder
from rlloom.data.source import PromptSource
from rlloom.data.types import PolicyUpdate, RolloutBatch, Sample, ValueUpdate
from rlloom.episodes.driver import EpisodeDriver
from rlloom.faults import at_stage_end
from rlloom.observability.metrics import MetricsAccumulator
from rlloom.observability.timers import StageTimer
from rlloom.rewards.runner import RewardRunner
from rlloom.trainer.policy import advantage_stage
from rlloom.trainer.rollout import RolloutResult, trained_reward_metrics
from rlloom.trainer.rollout_stream import RolloutStream, collect_rollouts

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class StepContext:
    """Everything a step needs that lives across steps."""

    cfg: RunConfig
    train_group: TrainGroup
    rollout_group: RolloutGroup
    weight_sync: WeightSync
    source: PromptSource
    runner: RewardRunner
    decode: ResponseDecoder
    stop_token_ids: list[int]
    on_samples: Callable[[list[Sample]], None] | None = None
    """Called with each step's scored samples (the trainer logs a few of them)."""
    critic_group: CriticGroup | None = None
    """PPO's critic (algorithm.estimator=gae), on the training ranks; None without one."""
    kl_coef: float | None = None
    """The adaptive KL controller's current coefficient (algorithm.kl_ctrl=adaptive; checkpoints keep
    it); None before its first step and with a fixed one (algorithm.kl_coef is used)."""
    episodes: EpisodeDriver | None = None
    """Multi-turn episodes (rollout.env, rollout.tools); None for single-turn generation."""
    stream: RolloutStream | None = None
    """The one rollout path (every trainer.mode); built from the fields above when not given."""

    def __post_init__(self) -> None:
        if self.stream is None:
            self.stream = RolloutStream(
                self.rollout_group,
                self.cfg,
                source=self.source,
                runner=self.runner,
                decode=self.decode,
                stop_token_ids=self.stop_token_ids,
                episodes=self.episodes,
            )


def is_single_pass(cfg: RunConfig) -> bool:
    """One optimizer step over the batch: the old (proximal) policy is the one being trained, so the
    old logprobs are the training forward's own, detached, and need no separate forward (the IS
    correction's weights against the rollout's logprobs are then taken in the loss)."""
    return cfg.trainer.ppo_epochs == 1 and cfg.trainer.num_mini_batches == 1


def rl_step(ctx: StepContext, step: int, rollout: RolloutResult | None = None) -> dict[str, float]:
    """One step; with `rollout` given (the asynchronous loop generated it) the step trains on it.
    Each stage's fault-injection point fires as its timer stops (`faults.at_stage_end`)."""
    cfg, train_group, rollout_group = ctx.cfg, ctx.train_group, ctx.rollout_group
    # Colocated, the rollout frees its KV cache for training; separate, it has its own GPUs.
    hand_over = cfg.rollout.sleep_during_train and cfg.cluster.placement == "colocated"
    timer = StageTimer(on_end=at_stage_end(step))
    metrics: dict[str, float] = {}

    if rollout is None:
        with timer("generate"):
            rollout = collect_rollouts(ctx.stream, step)
    metrics.update(rollout.metrics)
    if ctx.on_samples is not None:
        ctx.on_samples(rollout.samples)
    if not rollout.samples:  # dynamic sampling found no informative group: nothing to learn from
        return metrics | timer.seconds() | {"train/skipped_step": 1.0}
    metrics.update(trained_reward_metrics(rollout.samples))
    batch = RolloutBatch(rollout.samples)
    if hand_over:
        with timer("rollout_sleep"):
            rollout_group.sleep().result()  # the KV cache's memory goes to training until the sync

    with timer("old_logprobs"):
        old_logp_BT = old_logprobs(cfg, train_group, batch)
    with timer("ref_logprobs"):
        ref_logp_BT = train_group.ref_logprobs(batch).result() if cfg.algorithm.kl_coef > 0 else None
    critic, values_BT = ctx.critic_group, None
    if critic is not None:
        with timer("values"):
            values_BT = critic.values(batch).result()
    norm_constant = cfg.algorithm.norm_constant or cfg.rollout.max_new_tokens
    with timer("advantages"):
        adv = advantage_stage(
            cfg.algorithm,
            batch,
            norm_constant=norm_constant,
            old_logp_BT=old_logp_BT,
            ref_logp_BT=ref_logp_BT,
            values_BT=values_BT,
            kl_coef=ctx.kl_coef,
        )
    ctx.kl_coef = adv.kl_coef
    metrics.update(adv.metrics)
    if old_logp_BT is not None:
        metrics.update(logprob_gap(old_logp_BT, batch))

    with timer("train"):
        policy_due = critic is None or step >= cfg.critic.warmup_steps  # warm-up: the critic alone
        metrics.update(
            update_policy(
                cfg,
                train_group if policy_due else None,
                adv.update,
                norm_constant,
                seed=step,
                critic=None if adv.value_update is None else (critic, adv.value_update),
            )
        )
        warn_if_skipped(metrics, step)
    with timer("sync"):
        if hand_over:
            rollout_group.wake().result()
        metrics.update(ctx.weight_sync.sync())
    return metrics | throughput(timer.seconds(), batch, train_group.version)


def old_logprobs(cfg: RunConfig, train_group: TrainGroup, batch: RolloutBatch) -> torch.Tensor | None:
    """[B, T] logprobs of the policy before the update: the rollout's (algorithm.use_rollout_logprobs),
    a forward's when several updates or a KL reward need them, else None (a single pass: the loss
    detaches its own forward's, and weights IS from them). Under rollout.match_training the forward's
    would equal the rollout's bit for bit, so they are taken instead."""
    if cfg.algorithm.use_rollout_logprobs:
        return batch.rollout_logprobs()
    if is_single_pass(cfg) and not cfg.algorithm.kl_in_reward:
        return None
    if cfg.rollout.match_training:
        return batch.rollout_logprobs()
    # Per first-epoch mini-batch, so the forward sees exactly the micro-batches its update will:
    # the first update's importance ratio is then exactly 1.
    parts = [
        train_group.old_logprobs(batch.select(rows)) for rows in mini_batch_rows(cfg, len(batch), epoch=0)
    ]
    return torch.cat([p.result() for p in parts])


def warn_if_skipped(metrics: dict[str, float], step: int) -> None:
    if metrics.get("train/skipped_step", 0.0) > 0:
        log.warning(
            "step %d: %.0f%% of its optimizer steps were skipped because the loss, the gradient norm or the "
            "new parameters were not finite; the skipped ones changed neither the parameters nor the optimizer state",
            step + 1,
            100 * metrics["train/skipped_step"],
        )


def throughput(seconds: dict[str, float], batch: RolloutBatch, version: int) -> dict[str, float]:
    """The step's stage times, its total, its tokens per second and the policy version it ends at."""
    step_s = sum(seconds.values())
    return seconds | {
        "time/step_s": step_s,
        "perf/tokens": float(batch.num_tokens),
        "perf/step_tok_per_s": batch.num_tokens / max(step_s, 1e-9),
        "policy/version": float(version),
    }


def update_was_skipped(metrics: dict[str, float]) -> bool:
    """The step ran a policy update and none of its optimizer steps was applied (a step that dynamic
    sampling left without samples ran none and is not counted)."""
    return "train/grad_norm" in metrics and metrics.get("train/skipped_step", 0.0) == 1.0


def update_policy(
    cfg: RunConfig,
    train_group: TrainGroup | None,
    update: PolicyUpdate,
    norm_constant: int,
    *,
    seed: int,
    critic: tuple[CriticGroup, ValueUpdate] | None = None,
) -> dict[str, float]:
    """`ppo_epochs` passes over `num_mini_batches` mini-batches, one optimizer step each; their
    metrics combined with each one's declared reduction (a sum stays a sum, a max a max). With
    `critic` (PPO with a critic) the critic takes an optimizer step on each mini-batch first, on the
    same rows; a `train_group` of None (the critic's warm-up) leaves the policy as it is."""
    acc = MetricsAccumulator()
    whole = cfg.trainer.num_mini_batches == 1
    for epoch in range(cfg.trainer.ppo_epochs):
        for rows in mini_batch_rows(cfg, len(update.batch), epoch=epoch, seed=seed):
            if critic is not None:
                group, value_update = critic
                mini_value = value_update if whole else value_update.select(rows, value_normalizer)
                acc.add(group.update_critic(mini_value).result())
            if train_group is None:
                continue
            mini = (
                update
                if whole
                else update.select(
                    rows,
                    lambda mask_BT: loss_normalizer(
                        mask_BT, cfg.algorithm.agg_mode, norm_constant=norm_constant
                    ),
                )
            )
            acc.add(train_group.update_policy(mini).result())
    return acc.summary()


def mini_batch_rows(cfg: RunConfig, num_samples: int, *, epoch: int, seed: int = 0) -> list[list[int]]:
    """Rows of each mini-batch: contiguous in the first epoch (whole groups stay together), shuffled
    by (seed, epoch) in later ones."""
    order = list(range(num_samples))
    if epoch > 0:
        random.Random(f"{seed}:{epoch}").shuffle(order)
    # Near-equal contiguous chunks: dynamic sampling can leave a batch that does not divide evenly.
    bounds = [
        num_samples * m // cfg.trainer.num_mini_batches for m in range(cfg.trainer.num_mini_batches + 1)
    ]
    return [order[lo:hi] for lo, hi in zip(bounds, bounds[1:]) if hi > lo]


def logprob_gap(old_logp_BT: torch.Tensor, batch: RolloutBatch) -> dict[str, float]:
    """Train-vs-rollout logprob gap over valid tokens: mean |dlogp|, max |dlogp| (0.0 exactly when
    every token's two logprobs are equal) and mean exp|dlogp| (NeMo-RL's token_mult_prob_error; 1.0
    when the two agree)."""
    mask = batch.response_mask()
    diff = (old_logp_BT - batch.rollout_logprobs())[mask].abs().double()
    if diff.numel() == 0:
        return {
            "rollout/logp_gap_abs": 0.0,
            "rollout/logp_gap_max": 0.0,
            "rollout/token_mult_prob_error": 1.0,
        }
    return {
        "rollout/logp_gap_abs": float(diff.mean()),
        "rollout/logp_gap_max": float(diff.max()),
        "rollout/token_mult_prob_error": float(diff.exp().mean()),
    }
