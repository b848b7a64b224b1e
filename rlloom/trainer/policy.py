"""From scored samples to the policy update: advantages, IS weights and the loss normaliser; with a
critic (estimator gae) also the critic's regression targets. `advantage_stage` is the RL step's
advantage stage in one call.

The controller computes everything that needs the whole batch once, into a `PolicyUpdate`
(rlloom/data/types.py); the training engine then calls `rlloom.algorithms.objective.make_loss_fn`'s
loss per micro-batch with the rows it holds. Shape legend: B samples, T response tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlloom.algorithms import (
    adaptive_kl_coef,
    gae_advantages,
    grpo_advantages,
    loss_normalizer,
    masked_whiten,
    reinforce_pp_baseline_advantages,
    reinforce_pp_returns,
    rloo_advantages,
)
from rlloom.algorithms.kl import kl_estimate
from rlloom.algorithms.objective import correction_weights, is_correction, value_normalizer
from rlloom.config import AlgorithmConfig
from rlloom.data.types import PolicyUpdate, RolloutBatch, ValueUpdate


@dataclass(frozen=True, slots=True)
class Advantages:
    """What the advantage stage hands to the update stage."""

    update: PolicyUpdate
    """The policy's update: advantages, IS weights, the loss normaliser of the whole batch."""
    value_update: ValueUpdate | None
    """The critic's regression targets (PPO with a critic); None without a critic."""
    kl_coef: float | None
    """The KL coefficient of the next step: the adaptive controller's new one
    (algorithm.kl_ctrl=adaptive), else the one passed in."""
    metrics: dict[str, float]


def advantage_stage(
    algo: AlgorithmConfig,
    batch: RolloutBatch,
    *,
    norm_constant: int,
    old_logp_BT: torch.Tensor | None,
    ref_logp_BT: torch.Tensor | None,
    values_BT: torch.Tensor | None,
    kl_coef: float | None,
) -> Advantages:
    """The step's advantages: token rewards where the estimator needs them (a critic's `values_BT`,
    or algorithm.kl_in_reward's penalty at `kl_coef`, None for algorithm.kl_coef), then GAE and the
    critic's targets with a critic, else the critic-free estimator; the IS weights and the
    normaliser (`build_update`). Old and reference logprobs [B, T] are None where not computed."""
    metrics: dict[str, float] = {}
    adv_BT = value_update = None
    if values_BT is not None or algo.kl_in_reward:  # rewards on every token
        coef = algo.kl_coef if kl_coef is None else kl_coef
        rewards_BT, reward_metrics = token_rewards(algo, batch, old_logp_BT, ref_logp_BT, kl_coef=coef)
        metrics.update(reward_metrics)
        if algo.kl_ctrl == "adaptive":  # the next step's coefficient
            observed = reward_metrics["reward/kl"]
            kl_coef = adaptive_kl_coef(
                coef, observed, len(batch), target=algo.kl_target, horizon=algo.kl_horizon
            )
        if values_BT is None:  # reinforce_pp
            adv_BT = compute_advantages(algo, batch, rewards_BT)
        else:  # PPO with a critic: GAE, and the critic's targets
            mask_BT = batch.response_mask()
            adv_BT, returns_BT = gae_targets(algo, batch, values_BT, rewards_BT)
            metrics.update(value_metrics(values_BT, returns_BT, mask_BT))
            value_update = ValueUpdate(
                batch=batch,
                old_values_BT=values_BT,
                returns_BT=returns_BT,
                normalizer=value_normalizer(mask_BT),
            )
    update, update_metrics = build_update(
        algo,
        batch,
        norm_constant=norm_constant,
        old_logp_BT=old_logp_BT,
        ref_logp_BT=ref_logp_BT,
        advantages_BT=adv_BT,
    )
    metrics.update(update_metrics)
    return Advantages(update=update, value_update=value_update, kl_coef=kl_coef, metrics=metrics)


def outcome_token_rewards(batch: RolloutBatch) -> torch.Tensor:
    """[B, T] the sample's reward on its last valid response token, 0 elsewhere."""
    rewards_B, mask_BT = batch.rewards(), batch.response_mask()
    token_rewards_BT = torch.zeros(mask_BT.shape)
    last_B = torch.where(mask_BT.any(1), mask_BT.shape[1] - 1 - mask_BT.flip(1).int().argmax(1), 0)
    token_rewards_BT[torch.arange(len(batch)), last_B] = rewards_B * mask_BT.any(1)
    return token_rewards_BT


def token_rewards(
    algo: AlgorithmConfig,
    batch: RolloutBatch,
    old_logp_BT: torch.Tensor | None = None,
    ref_logp_BT: torch.Tensor | None = None,
    *,
    kl_coef: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """[B, T] rewards of a token-level estimator (gae, reinforce_pp): the outcome on the last token,
    plus with algorithm.kl_in_reward a penalty of -kl_coef x KL_t (`kl_kind`, between the policy
    before the update and the reference) on every token (`kl_coef`: the adaptive controller's
    coefficient; default algorithm.kl_coef). Metrics: `reward/kl_penalty`, what a sample's return
    loses to the penalty on average; `reward/kl`, the mean over samples of each one's mean
    per-token KL (what the adaptive controller observes); `reward/kl_coef`."""
    rewards_BT = outcome_token_rewards(batch)
    if not algo.kl_in_reward:
        return rewards_BT, {}
    if old_logp_BT is None or ref_logp_BT is None:
        raise ValueError("algorithm.kl_in_reward needs the old and the reference logprobs")
    coef = algo.kl_coef if kl_coef is None else kl_coef
    mask_BT = batch.response_mask()
    kl_BT = kl_estimate(old_logp_BT, ref_logp_BT, algo.kl_kind) * mask_BT
    penalty_BT = -coef * kl_BT
    tokens_B = mask_BT.sum(1)
    answered_B = tokens_B > 0
    per_sample_B = kl_BT.sum(1)[answered_B] / tokens_B[answered_B]
    metrics = {
        "reward/kl_penalty": float(-penalty_BT.sum(1).mean()),
        "reward/kl": float(per_sample_B.mean()) if per_sample_B.numel() else 0.0,
        "reward/kl_coef": coef,
    }
    return rewards_BT + penalty_BT, metrics


def gae_targets(
    algo: AlgorithmConfig, batch: RolloutBatch, values_BT: torch.Tensor, rewards_BT: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO with a critic: (advantages, returns) [B, T] from the token rewards (`token_rewards`) and
    the critic's values by GAE (`algorithm.gamma`, `algorithm.lam`); the advantages whitened over the
    batch's valid tokens (as verl), the returns (the critic's targets) not. Both 0 at masked positions."""
    mask_BT = batch.response_mask()
    adv_BT, returns_BT = gae_advantages(rewards_BT, values_BT, mask_BT, gamma=algo.gamma, lam=algo.lam)
    return masked_whiten(adv_BT, mask_BT) * mask_BT, returns_BT


def value_metrics(
    values_BT: torch.Tensor, returns_BT: torch.Tensor, mask_BT: torch.Tensor
) -> dict[str, float]:
    """The critic's fit before its update, over valid tokens: mean value, mean return, and the
    explained variance 1 - Var(returns - values) / Var(returns) (1 = perfect, 0 = no better than
    the mean; 0 when the returns do not vary)."""
    v, r = values_BT[mask_BT].double(), returns_BT[mask_BT].double()
    if v.numel() == 0:
        return {}
    var_r = r.var(unbiased=False)
    explained = 1.0 - float((r - v).var(unbiased=False) / var_r) if var_r > 0 else 0.0
    return {
        "critic/values_mean": float(v.mean()),
        "critic/returns_mean": float(r.mean()),
        "critic/vf_explained_var": explained,
    }


def compute_advantages(
    algo: AlgorithmConfig, batch: RolloutBatch, rewards_BT: torch.Tensor | None = None
) -> torch.Tensor:
    """adv_BT for the batch (0 at masked positions) from the configured critic-free estimator
    (`rewards_BT`: reinforce_pp's token rewards, `token_rewards`; default the outcome alone)."""
    rewards_B, groups_B, mask_BT = batch.rewards(), batch.group_ids(), batch.response_mask()
    if algo.uses_critic:
        raise ValueError("estimator gae needs the critic's values: use gae_targets")
    if algo.estimator in ("grpo", "dr_grpo", "rloo"):
        # A multi-turn trajectory split into several samples counts once in its group's statistics.
        first, index_B = batch.trajectory_rows()
        if algo.estimator == "rloo":
            adv_B = rloo_advantages(rewards_B[first], groups_B[first])[index_B]
        else:
            adv_B = grpo_advantages(rewards_B[first], groups_B[first], scale_by_std=algo.estimator == "grpo")[
                index_B
            ]
    elif algo.estimator == "reinforce_pp_baseline":
        return reinforce_pp_baseline_advantages(rewards_B, groups_B, mask_BT)
    else:  # reinforce_pp: outcome reward on the last valid token, discounted returns, whitened
        rewards_BT = outcome_token_rewards(batch) if rewards_BT is None else rewards_BT
        returns_BT = reinforce_pp_returns(rewards_BT, mask_BT, gamma=algo.gamma)
        return masked_whiten(returns_BT, mask_BT) * mask_BT
    return adv_B[:, None] * mask_BT


def build_update(
    algo: AlgorithmConfig,
    batch: RolloutBatch,
    *,
    norm_constant: int,
    old_logp_BT: torch.Tensor | None,
    ref_logp_BT: torch.Tensor | None,
    advantages_BT: torch.Tensor | None = None,
) -> tuple[PolicyUpdate, dict[str, float]]:
    """Advantages (`advantages_BT` when given: those of token rewards, `token_rewards`, e.g. GAE's
    from the critic), IS weights and the normaliser of the whole step's batch, with their metrics."""
    mask_BT = batch.response_mask()
    metrics: dict[str, float] = {}
    weights_BT = None
    correction = is_correction(algo)
    if correction is not None and old_logp_BT is not None:
        weights_BT, is_metrics = correction_weights(
            correction, old_logp_BT, batch.rollout_logprobs(), mask_BT
        )
        metrics.update({k: float(v) for k, v in is_metrics.items()})
    weight_B = batch.loss_weights()
    if bool((weight_B != 1).any()):  # down-weighted stale samples (trainer.stale_samples=downweight)
        weights_BT = (mask_BT.float() if weights_BT is None else weights_BT) * weight_B[:, None]
    update = PolicyUpdate(
        batch=batch,
        advantages_BT=compute_advantages(algo, batch) if advantages_BT is None else advantages_BT,
        old_logp_BT=old_logp_BT,
        ref_logp_BT=ref_logp_BT,
        is_weights_BT=weights_BT,
        normalizer=loss_normalizer(mask_BT, algo.agg_mode, norm_constant=norm_constant),
        # without old logprobs (a single pass) the loss weights by its own forward's logprobs
        correct_in_loss=correction if old_logp_BT is None else None,
    )
    adv_valid = update.advantages_BT[mask_BT]
    metrics["advantage/mean"] = float(adv_valid.mean()) if adv_valid.numel() else 0.0
    metrics["advantage/abs_mean"] = float(adv_valid.abs().mean()) if adv_valid.numel() else 0.0
    return update, metrics
