"""Per-token policy and value losses: PPO clip (with clip-higher and dual clip), GSPO, CISPO, clipped value loss.

Shape legend: B sequences, T response tokens. logp_BT is the log-probability of each sampled
response token under the policy being trained; old_logp_BT under the policy that the ratio is
taken against (the behaviour policy of this update). A mask is bool or 0/1 [B, T].

Each policy loss returns (loss_BT, metrics): loss_BT is exactly 0 at masked positions (and so
are its gradients), and the caller reduces it with `aggregate_loss` / `aggregate_loss_sum`
(re-exported here from `aggregation.py`). metrics are detached scalar tensors, averaged over
valid tokens, with keys `loss/...`; the same keys appear whether or not a feature is on.
"""

from __future__ import annotations

import torch

from rlloom.algorithms._masked import masked_frac, masked_mean
from rlloom.algorithms._validate import bool_mask, check_positive, check_same_shape, float_input
from rlloom.algorithms.aggregation import AGG_MODES, aggregate_loss, aggregate_loss_sum, loss_normalizer

__all__ = [
    "AGG_MODES",
    "aggregate_loss",
    "aggregate_loss_sum",
    "cispo_loss",
    "gspo_loss",
    "loss_normalizer",
    "ppo_clip_loss",
    "value_loss",
]

# exp() of a log-ratio above ~88 overflows fp32 to inf, and inf * 0 is NaN. e^20 ~ 5e8 is far
# outside any clip range, so clamping there changes only ratios that are broken anyway.
MAX_LOG_RATIO = 20.0
GSPO_MAX_LOG_RATIO = 10.0
"""GSPO's default ceiling on the sequence log-ratio (verl's value); see `gspo_loss`."""


def _policy_inputs(
    logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, adv: torch.Tensor, adv_name: str, mask_BT: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate and return (logp_BT, old_logp_BT, adv_BT broadcast to [B, T], bool mask_BT)."""
    logp_BT = float_input("logp_BT", logp_BT, ndim=2)
    old_logp_BT = float_input("old_logp_BT", old_logp_BT)
    check_same_shape("old_logp_BT", old_logp_BT, "logp_BT", logp_BT)
    mask_BT = bool_mask("mask_BT", mask_BT, logp_BT.shape, "logp_BT")
    adv = float_input(adv_name, adv)
    if adv.shape == logp_BT.shape[:1]:
        adv = adv[:, None].expand(logp_BT.shape)
    elif adv.shape != logp_BT.shape:
        raise ValueError(
            f"{adv_name} has shape {tuple(adv.shape)} but must be [B] = {tuple(logp_BT.shape[:1])} or "
            f"[B, T] = {tuple(logp_BT.shape)} like logp_BT. Fix: pass one advantage per sample or per token."
        )
    return logp_BT, old_logp_BT, adv, mask_BT


def _check_eps(eps_low: float | None, eps_high: float) -> None:
    if eps_low is not None and not 0 <= eps_low <= 1:
        raise ValueError(
            f"eps_low={eps_low!r} must be in [0, 1] (the ratio floor is 1 - eps_low). Fix: use 0.2."
        )
    if not eps_high >= 0:
        raise ValueError(
            f"eps_high={eps_high!r} must be >= 0 (the ratio ceiling is 1 + eps_high). Fix: use 0.2 or 0.28."
        )


def _k3_old_new(log_ratio_BT: torch.Tensor) -> torch.Tensor:
    """k3 estimate of KL(old || new) per token from log r = logp - old_logp: r - 1 - log r (>= 0)."""
    return torch.expm1(log_ratio_BT) - log_ratio_BT


def _masked_zero(loss_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    return torch.where(mask_BT, loss_BT, torch.zeros_like(loss_BT))


def ppo_clip_loss(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    adv_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip_c: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate per token (Schulman et al. 2017), asymmetric and optionally dual-clipped.

    r = exp(logp - old_logp);  loss = -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A).
    eps_high > eps_low is DAPO's clip-higher (Yu et al. 2025, eps_high = 0.28). With dual_clip_c = c
    (Dual-clip PPO, Ye et al. 2020) the loss of tokens with A < 0 is capped: loss = min(loss, -c * A).

    logp_BT, old_logp_BT: [B, T]. adv_BT: [B, T] or [B] (broadcast over tokens). mask_BT: [B, T].
    Returns (loss_BT [B, T], 0 at masked positions; metrics). Metrics, over valid tokens:
    loss/clipfrac_low (r < 1 - eps_low and A < 0: the lower clip zeroes the gradient),
    loss/clipfrac_high (r > 1 + eps_high and A > 0), loss/dual_clipfrac (the cap is active),
    loss/approx_kl (k3 estimate of KL(old || new): r - 1 - log r), loss/ratio_mean.
    """
    logp_BT, old_logp_BT, adv_BT, mask_BT = _policy_inputs(logp_BT, old_logp_BT, adv_BT, "adv_BT", mask_BT)
    _check_eps(eps_low, eps_high)
    if dual_clip_c is not None and not dual_clip_c > 1:
        raise ValueError(f"dual_clip_c={dual_clip_c!r} must be > 1 or None (off). Fix: use 3.0 or None.")
    log_ratio_BT = (logp_BT - old_logp_BT).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio_BT = torch.exp(log_ratio_BT)
    unclipped_BT = -adv_BT * ratio_BT
    clipped_BT = -adv_BT * ratio_BT.clamp(1 - eps_low, 1 + eps_high)
    loss_BT = torch.maximum(unclipped_BT, clipped_BT)
    dual_active_BT = torch.zeros_like(mask_BT)
    if dual_clip_c is not None:
        cap_BT = -dual_clip_c * adv_BT
        dual_active_BT = (adv_BT < 0) & (loss_BT > cap_BT)
        loss_BT = torch.where(dual_active_BT, cap_BT, loss_BT)
    with torch.no_grad():
        metrics = {
            "loss/clipfrac_low": masked_frac((ratio_BT < 1 - eps_low) & (adv_BT < 0), mask_BT),
            "loss/clipfrac_high": masked_frac((ratio_BT > 1 + eps_high) & (adv_BT > 0), mask_BT),
            "loss/dual_clipfrac": masked_frac(dual_active_BT, mask_BT),
            "loss/approx_kl": masked_mean(_k3_old_new(log_ratio_BT), mask_BT),
            "loss/ratio_mean": masked_mean(ratio_BT, mask_BT),
        }
    return _masked_zero(loss_BT, mask_BT), metrics


def gspo_loss(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    adv_B: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    max_log_ratio: float = GSPO_MAX_LOG_RATIO,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO, Group Sequence Policy Optimization (Zheng et al. 2025, Qwen), in its GSPO-token form.

    s_i = exp(mean over valid tokens t of (logp_t - old_logp_t)) is the length-normalised sequence
    ratio. Per token s_it = sg[s_i] * exp(logp_t - sg[logp_t]): equal to s_i in value, and its
    gradient is s_i * grad logp_t, so mean over t of the token losses has exactly GSPO's gradient.
    loss_it = -min(s_it * A_i, clip(s_it, 1 - eps_low, 1 + eps_high) * A_i). The paper's ranges are
    tiny (3e-4 / 4e-4) because s_i is a per-token geometric mean. GSPO is defined with the
    per-sequence token mean: reduce with mode "seq-mean-token-mean".

    The log of s_it is clamped from above at `max_log_ratio` (10, as verl does), and the gradient
    through the clamp is zero: a sequence whose policy drifted that far (s_i > e^10 ~ 2.2e4) is
    stale, and without the clamp a negative advantage, which the clip does not cap from above,
    would push a gradient of ~s_i per token (~7e3 at a sequence log-ratio of 12 with 23 tokens).

    logp_BT, old_logp_BT: [B, T]. adv_B: [B] (or [B, T] for GSPO-token's per-token advantages).
    mask_BT: [B, T]. Returns (loss_BT, 0 at masked; metrics): loss/clipfrac_low, loss/clipfrac_high
    (tokens whose sequence ratio is clipped, same sign rule as PPO), loss/approx_kl (token k3 of
    KL(old || new)), loss/ratio_mean (token mean of s_i).
    """
    logp_BT, old_logp_BT, adv_BT, mask_BT = _policy_inputs(logp_BT, old_logp_BT, adv_B, "adv_B", mask_BT)
    _check_eps(eps_low, eps_high)
    if not 0 < max_log_ratio <= MAX_LOG_RATIO:
        raise ValueError(
            f"max_log_ratio={max_log_ratio!r} must be in (0, {MAX_LOG_RATIO}] (exp of it must stay finite). "
            f"Fix: use {GSPO_MAX_LOG_RATIO}."
        )
    log_ratio_BT = _masked_zero(logp_BT - old_logp_BT, mask_BT)
    num_valid_B = mask_BT.sum(dim=1).clamp(min=1).to(logp_BT.dtype)
    seq_log_ratio_B = (log_ratio_BT.sum(dim=1) / num_valid_B).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    token_seq_log_ratio_BT = seq_log_ratio_B.detach()[:, None] + logp_BT - logp_BT.detach()
    ratio_BT = torch.exp(token_seq_log_ratio_BT.clamp(max=max_log_ratio))
    unclipped_BT = -adv_BT * ratio_BT
    clipped_BT = -adv_BT * ratio_BT.clamp(1 - eps_low, 1 + eps_high)
    loss_BT = torch.maximum(unclipped_BT, clipped_BT)
    with torch.no_grad():
        token_log_ratio_BT = log_ratio_BT.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        metrics = {
            "loss/clipfrac_low": masked_frac((ratio_BT < 1 - eps_low) & (adv_BT < 0), mask_BT),
            "loss/clipfrac_high": masked_frac((ratio_BT > 1 + eps_high) & (adv_BT > 0), mask_BT),
            "loss/approx_kl": masked_mean(_k3_old_new(token_log_ratio_BT), mask_BT),
            "loss/ratio_mean": masked_mean(ratio_BT, mask_BT),
        }
    return _masked_zero(loss_BT, mask_BT), metrics


def cispo_loss(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    adv_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    eps_low: float | None = None,
    eps_high: float = 0.28,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO, Clipped IS-weight Policy Optimization (MiniMax-M1, 2025).

    loss = -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * logp with r = exp(logp - old_logp): the
    importance weight is clipped and detached instead of the update, so every token keeps a
    gradient (PPO zeroes clipped tokens). The paper sets no lower bound ("eps_low large") and tunes
    only eps_high without publishing its value; eps_low=None here means no lower bound, and
    eps_high=0.28 follows DAPO's clip-higher (other stacks use larger ceilings, e.g. ratio <= 4-6).

    logp_BT, old_logp_BT: [B, T]. adv_BT: [B, T] or [B]. mask_BT: [B, T].
    Returns (loss_BT, 0 at masked; metrics): loss/clipfrac_low, loss/clipfrac_high (weight clipped,
    any sign of A), loss/approx_kl (k3 of KL(old || new)), loss/ratio_mean.
    """
    logp_BT, old_logp_BT, adv_BT, mask_BT = _policy_inputs(logp_BT, old_logp_BT, adv_BT, "adv_BT", mask_BT)
    _check_eps(eps_low, eps_high)
    with torch.no_grad():
        log_ratio_BT = (logp_BT - old_logp_BT).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        ratio_BT = torch.exp(log_ratio_BT)
        low = None if eps_low is None else 1 - eps_low
        weight_BT = ratio_BT.clamp(min=low, max=1 + eps_high)
        below_BT = torch.zeros_like(mask_BT) if low is None else ratio_BT < low
        metrics = {
            "loss/clipfrac_low": masked_frac(below_BT, mask_BT),
            "loss/clipfrac_high": masked_frac(ratio_BT > 1 + eps_high, mask_BT),
            "loss/approx_kl": masked_mean(_k3_old_new(log_ratio_BT), mask_BT),
            "loss/ratio_mean": masked_mean(ratio_BT, mask_BT),
        }
    loss_BT = -weight_BT * adv_BT * logp_BT
    return _masked_zero(loss_BT, mask_BT), metrics


def value_loss(
    values_BT: torch.Tensor,
    old_values_BT: torch.Tensor,
    returns_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    clip: float,
) -> torch.Tensor:
    """Clipped value loss of PPO: 0.5 * max((v - R)^2, (clip(v, v_old - clip, v_old + clip) - R)^2).

    values_BT: [B, T] critic values being trained. old_values_BT: [B, T] values at rollout time.
    returns_BT: [B, T] targets (e.g. GAE returns). mask_BT: [B, T]. clip: > 0.
    Returns loss_BT: [B, T], 0 at masked positions.
    """
    values_BT = float_input("values_BT", values_BT, ndim=2)
    old_values_BT = float_input("old_values_BT", old_values_BT)
    returns_BT = float_input("returns_BT", returns_BT)
    check_same_shape("old_values_BT", old_values_BT, "values_BT", values_BT)
    check_same_shape("returns_BT", returns_BT, "values_BT", values_BT)
    mask_BT = bool_mask("mask_BT", mask_BT, values_BT.shape, "values_BT")
    check_positive("clip", clip)
    clipped_BT = old_values_BT + (values_BT - old_values_BT).clamp(-clip, clip)
    loss_BT = 0.5 * torch.maximum((values_BT - returns_BT).square(), (clipped_BT - returns_BT).square())
    return _masked_zero(loss_BT, mask_BT)
