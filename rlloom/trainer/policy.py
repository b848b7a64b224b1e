"""From scored samples to the policy loss: advantages, the per-update tensors, and the loss function.

The controller computes everything that needs the whole batch (advantages, the loss normaliser,
IS weights) once, into a `PolicyUpdate`; the training engine then calls the loss function per
micro-batch with the rows it holds. Shape legend: B samples, T response tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rlloom.algorithms import (
    aggregate_loss_sum,
    cispo_loss,
    grpo_advantages,
    gspo_loss,
    is_weights,
    kl_estimate,
    loss_normalizer,
    masked_whiten,
    ppo_clip_loss,
    reinforce_pp_baseline_advantages,
    reinforce_pp_returns,
    rloo_advantages,
)
from rlloom.config.components import AlgorithmConfig
from rlloom.data.types import RolloutBatch
from rlloom.devices import to_device
from rlloom.engines.train.base import LossFn


def compute_advantages(algo: AlgorithmConfig, batch: RolloutBatch) -> torch.Tensor:
    """adv_BT for the batch (0 at masked positions) from the configured estimator."""
    rewards_B, groups_B, mask_BT = batch.rewards(), batch.group_ids(), batch.response_mask()
    if algo.estimator in ("grpo", "dr_grpo"):
        adv_B = grpo_advantages(rewards_B, groups_B, scale_by_std=algo.estimator == "grpo")
    elif algo.estimator == "rloo":
        adv_B = rloo_advantages(rewards_B, groups_B)
    elif algo.estimator == "reinforce_pp_baseline":
        return reinforce_pp_baseline_advantages(rewards_B, groups_B, mask_BT)
    else:  # reinforce_pp: outcome reward on the last valid token, discounted returns, whitened
        token_rewards_BT = torch.zeros(mask_BT.shape)
        last_B = torch.where(mask_BT.any(1), mask_BT.shape[1] - 1 - mask_BT.flip(1).int().argmax(1), 0)
        token_rewards_BT[torch.arange(len(batch)), last_B] = rewards_B * mask_BT.any(1)
        returns_BT = reinforce_pp_returns(token_rewards_BT, mask_BT, gamma=algo.gamma)
        return masked_whiten(returns_BT, mask_BT) * mask_BT
    return adv_B[:, None] * mask_BT


@dataclass(kw_only=True, slots=True)
class PolicyUpdate:
    """Per-token tensors of one mini-batch, in the order of its samples."""

    batch: RolloutBatch
    """The mini-batch the engine trains on."""
    advantages_BT: torch.Tensor
    """[B, T] advantages (0 at masked)."""
    old_logp_BT: torch.Tensor | None
    """[B, T] behaviour-policy logprobs; None = on-policy single pass: the detached current logprobs."""
    ref_logp_BT: torch.Tensor | None
    """[B, T] reference-policy logprobs when a KL loss is on."""
    is_weights_BT: torch.Tensor | None
    """[B, T] detached train/inference mismatch weights when IS correction is on."""
    normalizer: float
    """Global loss normaliser of this mini-batch for the aggregation mode."""

    def select(self, rows: Sequence[int], algo: AlgorithmConfig, norm_constant: int) -> PolicyUpdate:
        """The update of a subset of rows as its own mini-batch (normaliser recomputed)."""
        idx = torch.as_tensor(list(rows), dtype=torch.int64)
        sub = self.batch.select(list(rows))
        pick = lambda x: None if x is None else x[idx]
        return PolicyUpdate(
            batch=sub,
            advantages_BT=self.advantages_BT[idx],
            old_logp_BT=pick(self.old_logp_BT),
            ref_logp_BT=pick(self.ref_logp_BT),
            is_weights_BT=pick(self.is_weights_BT),
            normalizer=loss_normalizer(sub.response_mask(), algo.agg_mode, norm_constant=norm_constant),
        )


def build_update(
    algo: AlgorithmConfig,
    batch: RolloutBatch,
    *,
    norm_constant: int,
    old_logp_BT: torch.Tensor | None,
    ref_logp_BT: torch.Tensor | None,
) -> tuple[PolicyUpdate, dict[str, float]]:
    """Advantages, IS weights and the normaliser of the whole step's batch, with their metrics."""
    mask_BT = batch.response_mask()
    metrics: dict[str, float] = {}
    weights_BT = None
    if algo.is_correction != "none":
        if old_logp_BT is None:
            raise ValueError(
                "algorithm.is_correction needs recomputed old logprobs to compare with the rollout's; "
                "it cannot be combined with the on-policy shortcut. Fix: set algorithm.is_correction=none "
                "or trainer.ppo_epochs/num_mini_batches so that old logprobs are recomputed."
            )
        mode = "truncate" if algo.is_correction == "tis" else "mask"
        low = algo.is_low if algo.is_low > 0 else None
        weights_BT, is_metrics = is_weights(
            old_logp_BT,
            batch.rollout_logprobs(),
            mask_BT,
            level=algo.is_level,
            mode=mode,
            low=low,
            high=algo.is_high,
        )
        metrics.update({k: float(v) for k, v in is_metrics.items()})
    update = PolicyUpdate(
        batch=batch,
        advantages_BT=compute_advantages(algo, batch),
        old_logp_BT=old_logp_BT,
        ref_logp_BT=ref_logp_BT,
        is_weights_BT=weights_BT,
        normalizer=loss_normalizer(mask_BT, algo.agg_mode, norm_constant=norm_constant),
    )
    adv_valid = update.advantages_BT[mask_BT]
    metrics["advantage/mean"] = float(adv_valid.mean()) if adv_valid.numel() else 0.0
    metrics["advantage/abs_mean"] = float(adv_valid.abs().mean()) if adv_valid.numel() else 0.0
    return update, metrics


def make_loss_fn(algo: AlgorithmConfig, update: PolicyUpdate) -> LossFn:
    """The per-micro-batch loss of the configured policy loss, KL and entropy terms."""
    mask_all_BT = update.batch.response_mask()
    # In a single pass the current logprobs are the trainer's view of the rollout policy: the
    # train-vs-rollout gap is measured here, at no extra forward.
    rollout_BT = update.batch.rollout_logprobs() if update.old_logp_BT is None else None

    def loss_fn(
        logp_bT: torch.Tensor, entropy_bT: torch.Tensor | None, rows_b: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        rows_b = rows_b.to("cpu")
        dev = logp_bT.device

        def rows(t_BT: torch.Tensor) -> torch.Tensor:  # this micro-batch's rows, copied without a sync
            return to_device(t_BT[rows_b], dev)

        mask_bT = rows(mask_all_BT)
        adv_bT = rows(update.advantages_BT)
        old_bT = logp_bT.detach() if update.old_logp_BT is None else rows(update.old_logp_BT)
        if algo.loss == "ppo_clip":
            dual = algo.dual_clip_c if algo.dual_clip_c > 0 else None
            loss_bT, metrics = ppo_clip_loss(
                logp_bT,
                old_bT,
                adv_bT,
                mask_bT,
                eps_low=algo.eps_low,
                eps_high=algo.eps_high,
                dual_clip_c=dual,
            )
        elif algo.loss == "gspo":
            loss_bT, metrics = gspo_loss(
                logp_bT, old_bT, adv_bT, mask_bT, eps_low=algo.eps_low, eps_high=algo.eps_high
            )
        else:
            loss_bT, metrics = cispo_loss(logp_bT, old_bT, adv_bT, mask_bT, eps_high=algo.eps_high)
        if update.is_weights_BT is not None:
            loss_bT = loss_bT * rows(update.is_weights_BT)
        if algo.kl_coef > 0:
            assert update.ref_logp_BT is not None, "KL loss on but no reference logprobs"
            kl_bT = kl_estimate(logp_bT, rows(update.ref_logp_BT), algo.kl_kind) * mask_bT
            loss_bT = loss_bT + algo.kl_coef * kl_bT
            metrics["loss/kl"] = (kl_bT.sum() / mask_bT.sum().clamp(min=1)).detach()
        if algo.entropy_coef > 0:
            assert entropy_bT is not None, "entropy bonus on but the engine returned no entropy"
            loss_bT = loss_bT - algo.entropy_coef * entropy_bT * mask_bT
        if rollout_BT is not None:
            gap_bT = (logp_bT.detach() - rows(rollout_BT)).abs()
            count = mask_bT.sum().clamp(min=1)
            metrics["rollout/logp_gap_abs"] = (gap_bT * mask_bT).sum() / count
            metrics["rollout/token_mult_prob_error"] = (torch.exp(gap_bT) * mask_bT).sum() / count
        if entropy_bT is not None:
            metrics["actor/entropy"] = ((entropy_bT * mask_bT).sum() / mask_bT.sum().clamp(min=1)).detach()
        return aggregate_loss_sum(loss_bT, mask_bT, algo.agg_mode), metrics

    return loss_fn
