"""Importance-sampling corrections for the mismatch between the rollout engine and the trainer.

Shape legend: B sequences, T response tokens; a mask is bool or 0/1 [B, T].

The rollout engine samples with logprobs `rollout_logp` (other kernels, maybe lower precision);
the trainer recomputes `old_logp` for the same tokens. The gap biases the policy gradient; the
weight old / rollout corrects it. Two ways to bound its variance:
- "truncate": truncated importance sampling (TIS; Yao et al. 2025, "Your efficient RL framework
  secretly brings you off-policy RL training"): w = min(ratio, high), and max(w, low) if low is given.
- "mask": masked importance sampling (MIS; "icepop" in Ling Team's Ring-1T): w = ratio where
  low <= ratio <= high, else 0 (the token is dropped). low=None means 0: no lower bound.
The weights are detached (a stop-gradient coefficient) and multiply the per-token policy loss.
"""

from __future__ import annotations

import torch

from rlloom.algorithms._masked import masked_frac, masked_mean
from rlloom.algorithms._validate import bool_mask, check_same_shape, float_input

# exp() of a summed sequence log-ratio overflows quickly (hundreds of tokens); clamping to
# [-20, 20] keeps the ratio finite while leaving it far outside any sensible [low, high].
MAX_LOG_RATIO = 20.0


def _check_bounds(mode: str, level: str, low: float | None, high: float) -> None:
    if level not in ("token", "sequence"):
        raise ValueError(f"level={level!r} must be 'token' or 'sequence'. Fix: use 'token'.")
    if mode not in ("truncate", "mask"):
        raise ValueError(f"mode={mode!r} must be 'truncate' (TIS) or 'mask' (MIS). Fix: use 'truncate'.")
    if not high > 0:
        raise ValueError(f"high={high!r} must be > 0. Fix: use 2.0.")
    if low is not None and not 0 <= low < high:
        raise ValueError(
            f"low={low!r} must be in [0, high={high!r}) or None (no lower bound). Fix: use None."
        )


def is_weights(
    old_logp_BT: torch.Tensor,
    rollout_logp_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    level: str = "token",
    mode: str = "truncate",
    low: float | None = None,
    high: float = 2.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Detached importance weights old / rollout for the train/inference mismatch.

    level "token": ratio_t = exp(old_t - rollout_t). level "sequence": ratio_i = exp(sum over valid
    t of (old_t - rollout_t)), the summed log-ratio clamped to [-20, 20], broadcast over the tokens.
    mode "truncate": w = min(ratio, high) (and max(w, low) if low is given).
    mode "mask": w = ratio if (low or 0) <= ratio <= high else 0.

    old_logp_BT, rollout_logp_BT: [B, T]. mask_BT: [B, T].
    Returns (weights_BT [B, T], detached, 0 at masked positions; metrics over valid tokens):
    is/weight_mean, is/frac_truncated (truncate) or is/frac_masked (mask), is/mean_abs_logp_diff.
    """
    old_logp_BT = float_input("old_logp_BT", old_logp_BT, ndim=2)
    rollout_logp_BT = float_input("rollout_logp_BT", rollout_logp_BT)
    check_same_shape("rollout_logp_BT", rollout_logp_BT, "old_logp_BT", old_logp_BT)
    mask_BT = bool_mask("mask_BT", mask_BT, old_logp_BT.shape, "old_logp_BT")
    _check_bounds(mode, level, low, high)
    with torch.no_grad():
        diff_BT = torch.where(mask_BT, old_logp_BT - rollout_logp_BT, torch.zeros_like(old_logp_BT))
        if level == "token":
            log_ratio_BT = diff_BT.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        else:
            seq_log_ratio_B = diff_BT.sum(dim=1).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
            log_ratio_BT = seq_log_ratio_B[:, None].expand(diff_BT.shape)
        ratio_BT = torch.exp(log_ratio_BT)
        floor = 0.0 if low is None else low
        outside_BT = (ratio_BT > high) | (ratio_BT < floor)
        if mode == "truncate":
            weights_BT = ratio_BT.clamp(min=low, max=high)
            frac_key = "is/frac_truncated"
        else:
            weights_BT = torch.where(outside_BT, torch.zeros_like(ratio_BT), ratio_BT)
            frac_key = "is/frac_masked"
        weights_BT = torch.where(mask_BT, weights_BT, torch.zeros_like(weights_BT))
        metrics = {
            "is/weight_mean": masked_mean(weights_BT, mask_BT),
            frac_key: masked_frac(outside_BT, mask_BT),
            "is/mean_abs_logp_diff": masked_mean(diff_BT.abs(), mask_BT),
        }
    return weights_BT, metrics
