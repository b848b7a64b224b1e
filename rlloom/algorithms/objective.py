"""The policy objective as the training engine calls it: one loss function per update.

`make_loss_fn(algo, update)` closes over a `PolicyUpdate` (advantages, old/reference logprobs, IS
weights of the global batch, computed once by the controller; in a single pass the IS weights are
taken here from the forward's own logprobs, `update.correct_in_loss`) and returns the `LossFn` the engine
calls per micro-batch with the rows it holds: the configured policy loss (PPO clip, GSPO or CISPO),
optional IS correction, KL and entropy terms, summed for `aggregate_loss_sum`'s normaliser.
Shape legend: B samples of the global batch, b of a micro-batch, T response tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

from rlloom.algorithms._masked import masked_frac, masked_mean
from rlloom.algorithms.aggregation import aggregate_loss_sum, loss_normalizer
from rlloom.algorithms.corrections import is_weights
from rlloom.algorithms.kl import kl_estimate
from rlloom.algorithms.losses import cispo_loss, gspo_loss, ppo_clip_loss, value_loss
from rlloom.config import AlgorithmConfig
from rlloom.data.types import ISCorrection, PolicyUpdate, ValueUpdate
from rlloom.devices import to_device
from rlloom.observability.metrics import Max

LossFn = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor], tuple[torch.Tensor, Mapping[str, Any]]]
"""loss_fn(logp_bT, entropy_bT | None, mb_indices_b) -> (loss_sum, metrics), called per micro-batch.

logp_bT / entropy_bT: [b, T] fp32 on the engine's device, 0 where the response mask is false.
mb_indices_b: [b] int64 (CPU), the rows of the global batch in this micro-batch, in order; the
caller indexes its own per-sample tensors (advantages, old logprobs, mask) with it.
loss_sum: scalar, the micro-batch's numerator, e.g. `aggregate_loss_sum(loss_bT, mask_bT, mode)`;
the engine divides it by the global `loss_normalizer`.
metrics: scalars (averaged over micro-batches weighted by response tokens) or
`rlloom.observability.metrics` Mean/Sum/Max/Min values.
"""


def is_correction(algo: AlgorithmConfig) -> ISCorrection | None:
    """`algorithm.is_correction`'s settings, or None when it is off."""
    if algo.is_correction == "none":
        return None
    mode = "truncate" if algo.is_correction == "tis" else "mask"
    return ISCorrection(
        level=algo.is_level, mode=mode, low=algo.is_low if algo.is_low > 0 else None, high=algo.is_high
    )


def correction_weights(
    correction: ISCorrection, old_logp_BT: torch.Tensor, rollout_logp_BT: torch.Tensor, mask_BT: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The IS weights old / rollout (detached) and their metrics."""
    return is_weights(old_logp_BT, rollout_logp_BT, mask_BT, **dataclasses.asdict(correction))


def make_loss_fn(algo: AlgorithmConfig, update: PolicyUpdate) -> LossFn:
    """The per-micro-batch loss of the configured policy loss, KL and entropy terms."""
    mask_all_BT = update.batch.response_mask()
    # In a single pass (no old logprobs recomputed) the current logprobs, detached, are the old
    # ones: the train-vs-rollout gap and the IS correction's weights are taken here, at no extra
    # forward. Per micro-batch is exact: a sequence is never split between micro-batches, and the
    # token means are averaged over micro-batches by their response tokens.
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
        if update.correct_in_loss is not None:
            assert rollout_BT is not None, "an in-loss IS correction needs a single pass (no old logprobs)"
            weights_bT, is_metrics = correction_weights(
                update.correct_in_loss, logp_bT.detach(), rows(rollout_BT), mask_bT
            )
            loss_bT = loss_bT * weights_bT
            metrics.update(is_metrics)
        if algo.kl_coef > 0 and not algo.kl_in_reward:  # in the reward, the advantages hold it
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
            metrics["rollout/logp_gap_max"] = Max(gap_bT.masked_fill(mask_bT == 0, 0.0).amax())
            metrics["rollout/token_mult_prob_error"] = (torch.exp(gap_bT) * mask_bT).sum() / count
        if entropy_bT is not None:
            metrics["actor/entropy"] = ((entropy_bT * mask_bT).sum() / mask_bT.sum().clamp(min=1)).detach()
        return aggregate_loss_sum(loss_bT, mask_bT, algo.agg_mode), metrics

    return loss_fn


VALUE_AGG_MODE = "token-mean"
"""How the critic's per-token value losses reduce (verl's critic default)."""


def value_normalizer(mask_BT: torch.Tensor) -> float:
    """The critic's global loss normaliser of a (mini-)batch: `loss_normalizer` of VALUE_AGG_MODE."""
    return loss_normalizer(mask_BT, VALUE_AGG_MODE)


def make_value_loss_fn(update: ValueUpdate, *, clip: float) -> LossFn:
    """The critic's per-micro-batch loss (PPO with a critic): the clipped value loss (`value_loss`)
    summed over the micro-batch's response tokens; with `update.normalizer` (`value_normalizer`)
    the engine makes it a token mean over the mini-batch, exact under any micro-batching. The
    engine passes the critic's values where a policy gets its logprobs."""
    mask_all_BT = update.batch.response_mask()

    def loss_fn(
        values_bT: torch.Tensor, entropy_bT: torch.Tensor | None, rows_b: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        rows_b = rows_b.to("cpu")
        dev = values_bT.device
        mask_bT = to_device(mask_all_BT[rows_b], dev)
        old_bT = to_device(update.old_values_BT[rows_b], dev)
        returns_bT = to_device(update.returns_BT[rows_b], dev)
        loss_bT = value_loss(values_bT, old_bT, returns_bT, mask_bT, clip=clip)
        with torch.no_grad():  # verl's vf_clipfrac: where the clipped value's loss is the one taken
            clipped_bT = old_bT + (values_bT - old_bT).clamp(-clip, clip)
            taken_clipped_bT = (clipped_bT - returns_bT).square() > (values_bT - returns_bT).square()
            metrics = {
                "critic/vf_clipfrac": masked_frac(taken_clipped_bT, mask_bT),
                "critic/vpred_mean": masked_mean(values_bT.detach(), mask_bT),
            }
        return aggregate_loss_sum(loss_bT, mask_bT, VALUE_AGG_MODE), metrics

    return loss_fn
