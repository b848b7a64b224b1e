"""Advantage estimators: GRPO / Dr.GRPO, RLOO, REINFORCE++ (with and without group baseline), GAE.

Shape legend: B samples (completions) in the batch, T response tokens (the batch's width),
G groups (samples of one prompt share a group id). A mask is bool or 0/1 [B, T]: true for
response tokens that are trained on; false for padding and for e.g. tool output inside a
multi-turn response.

All functions are pure: they never modify their inputs and return new tensors. Outcome-reward
estimators return `adv_B`; the caller broadcasts it over tokens (`adv_B[:, None]`). Token-level
estimators return `_BT` tensors that are exactly 0 at masked positions.
"""

from __future__ import annotations

import torch

from rlloom.algorithms._groups import group_centered, group_count, group_index, group_sum
from rlloom.algorithms._validate import bool_mask, check_group_ids, check_same_shape, float_input


def _check_rewards(rewards_B: object, group_ids_B: object) -> tuple[torch.Tensor, torch.Tensor]:
    rewards_B = float_input("rewards_B", rewards_B, ndim=1)
    return rewards_B, check_group_ids(group_ids_B, rewards_B.numel())


def grpo_advantages(
    rewards_B: torch.Tensor, group_ids_B: torch.Tensor, *, scale_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Group-relative advantages of GRPO (Shao et al. 2024, DeepSeekMath).

    adv_i = (r_i - mean_g(r)) / (std_g(r) + eps) with the unbiased (Bessel, n - 1) std of the group
    g of sample i. `scale_by_std=False` is Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like
    Training"): adv_i = r_i - mean_g(r), no division, which removes the question-difficulty bias.
    A group of one sample gets advantage 0.

    rewards_B: [B] scalar reward per sample. group_ids_B: [B] integer group id per sample.
    Returns adv_B: [B], in the dtype of rewards_B.
    """
    rewards_B, group_ids_B = _check_rewards(rewards_B, group_ids_B)
    index_B, num_groups = group_index(group_ids_B)
    count_G = group_count(index_B, num_groups, rewards_B.dtype)
    mean_G = group_sum(rewards_B, index_B, num_groups) / count_G
    centered_B = rewards_B - mean_G[index_B]
    singleton_B = count_G[index_B] < 2
    if scale_by_std:
        # Bessel-corrected variance; groups of one divide by 1 and are zeroed below anyway.
        var_G = group_sum(centered_B.square(), index_B, num_groups) / (count_G - 1).clamp(min=1)
        centered_B = centered_B / (var_G.sqrt()[index_B] + eps)
    return torch.where(singleton_B, torch.zeros_like(centered_B), centered_B)


def rloo_advantages(rewards_B: torch.Tensor, group_ids_B: torch.Tensor) -> torch.Tensor:
    """REINFORCE Leave-One-Out (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics").

    adv_i = r_i - (1 / (n - 1)) * sum_{j in g, j != i} r_j, which equals n / (n - 1) * (r_i - mean_g(r))
    for a group of n >= 2. A group of one sample gets advantage 0.

    rewards_B: [B]. group_ids_B: [B] integer. Returns adv_B: [B].
    """
    rewards_B, group_ids_B = _check_rewards(rewards_B, group_ids_B)
    index_B, num_groups = group_index(group_ids_B)
    count_B = group_count(index_B, num_groups, rewards_B.dtype)[index_B]
    sum_B = group_sum(rewards_B, index_B, num_groups)[index_B]
    others_mean_B = (sum_B - rewards_B) / (count_B - 1).clamp(min=1)
    adv_B = rewards_B - others_mean_B
    return torch.where(count_B < 2, torch.zeros_like(adv_B), adv_B)


def reinforce_pp_returns(
    token_rewards_BT: torch.Tensor, mask_BT: torch.Tensor, *, gamma: float = 1.0
) -> torch.Tensor:
    """Discounted return-to-go of REINFORCE++ (Hu 2025): G_t = r_t + gamma * G_{t'}.

    t' is the next VALID token after t: a masked position (padding, or tool output inside a
    multi-turn response) adds no reward and no discount step; the return passes over it unchanged.
    Usually the outcome reward sits on the last valid token (and a per-token KL penalty on every one).

    token_rewards_BT: [B, T] reward of each token. mask_BT: [B, T] bool or 0/1. gamma: in [0, 1].
    Returns returns_BT: [B, T], 0 at masked positions.
    """
    token_rewards_BT = float_input("token_rewards_BT", token_rewards_BT, ndim=2)
    mask_BT = bool_mask("mask_BT", mask_BT, token_rewards_BT.shape, "token_rewards_BT")
    if not 0 <= gamma <= 1:
        raise ValueError(f"gamma={gamma!r} must be in [0, 1]. Fix: use 1.0 (undiscounted) or e.g. 0.99.")
    running_B = torch.zeros_like(token_rewards_BT[:, 0])
    columns = []
    for t in reversed(range(token_rewards_BT.shape[1])):
        valid_B = mask_BT[:, t]
        running_B = torch.where(valid_B, token_rewards_BT[:, t] + gamma * running_B, running_B)
        columns.append(torch.where(valid_B, running_B, torch.zeros_like(running_B)))
    return torch.stack(columns[::-1], dim=1) if columns else torch.zeros_like(token_rewards_BT)


def reinforce_pp_baseline_advantages(
    rewards_B: torch.Tensor, group_ids_B: torch.Tensor, mask_BT: torch.Tensor
) -> torch.Tensor:
    """REINFORCE++-baseline (Hu 2025): group-mean baseline, then batch whitening over tokens.

    a_i = r_i - mean_g(r), broadcast to every token of sample i, then
    adv = masked_whiten(a, mask) over all valid tokens of the batch (mean 0, unbiased std 1).
    A group of one sample has a_i = 0 before whitening (it only gets the whitening shift).

    rewards_B: [B]. group_ids_B: [B] integer. mask_BT: [B, T] bool or 0/1.
    Returns adv_BT: [B, T], 0 at masked positions.
    """
    rewards_B, group_ids_B = _check_rewards(rewards_B, group_ids_B)
    if not isinstance(mask_BT, torch.Tensor) or mask_BT.dim() != 2 or mask_BT.shape[0] != rewards_B.numel():
        shape = tuple(mask_BT.shape) if isinstance(mask_BT, torch.Tensor) else type(mask_BT).__name__
        raise ValueError(
            f"mask_BT has shape {shape} but must be [B, T] with B = {rewards_B.numel()} (len of rewards_B). "
            "Fix: pass the response mask of the same batch."
        )
    mask_BT = bool_mask("mask_BT", mask_BT, mask_BT.shape, "mask_BT")
    centered_B, _ = group_centered(rewards_B, group_ids_B)
    scores_BT = centered_B[:, None].expand(mask_BT.shape)
    return masked_whiten(scores_BT, mask_BT)


def gae_advantages(
    token_rewards_BT: torch.Tensor,
    values_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016) for PPO with a critic.

    delta_t = r_t + gamma * V_{t'} - V_t,  A_t = delta_t + gamma * lam * A_{t'},  R_t = A_t + V_t,
    where t' is the next VALID token (V and A are 0 after the last one). Masked positions are
    skipped: the next value and the running advantage jump over them. Not whitened.

    token_rewards_BT, values_BT: [B, T]. mask_BT: [B, T] bool or 0/1. gamma, lam: in [0, 1].
    Returns (adv_BT, returns_BT): [B, T] each, 0 at masked positions.
    """
    token_rewards_BT = float_input("token_rewards_BT", token_rewards_BT, ndim=2)
    values_BT = float_input("values_BT", values_BT, ndim=2)
    check_same_shape("values_BT", values_BT, "token_rewards_BT", token_rewards_BT)
    mask_BT = bool_mask("mask_BT", mask_BT, token_rewards_BT.shape, "token_rewards_BT")
    for name, value in (("gamma", gamma), ("lam", lam)):
        if not 0 <= value <= 1:
            raise ValueError(f"{name}={value!r} must be in [0, 1]. Fix: use e.g. gamma=1.0, lam=0.95.")
    next_value_B = torch.zeros_like(values_BT[:, 0])
    running_B = torch.zeros_like(next_value_B)
    columns = []
    for t in reversed(range(values_BT.shape[1])):
        valid_B = mask_BT[:, t]
        delta_B = token_rewards_BT[:, t] + gamma * next_value_B - values_BT[:, t]
        running_B = torch.where(valid_B, delta_B + gamma * lam * running_B, running_B)
        next_value_B = torch.where(valid_B, values_BT[:, t], next_value_B)
        columns.append(torch.where(valid_B, running_B, torch.zeros_like(running_B)))
    adv_BT = torch.stack(columns[::-1], dim=1) if columns else torch.zeros_like(values_BT)
    returns_BT = torch.where(mask_BT, adv_BT + values_BT, torch.zeros_like(values_BT))
    return adv_BT, returns_BT


def masked_whiten(
    x_BT: torch.Tensor, mask_BT: torch.Tensor, *, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Whiten x over its valid entries: (x - mean) / sqrt(var + eps); shift_mean=False adds the mean back.

    mean and the unbiased (n - 1) variance are taken over valid entries only. With one valid entry
    the variance is taken as 0; with none the result is all zeros.

    x_BT: [B, T]. mask_BT: [B, T] bool or 0/1. Returns [B, T], 0 at masked positions.
    """
    x_BT = float_input("x_BT", x_BT, ndim=2)
    mask_BT = bool_mask("mask_BT", mask_BT, x_BT.shape, "x_BT")
    zeros_BT = torch.zeros_like(x_BT)
    num_valid = mask_BT.sum().to(x_BT.dtype)
    mean = torch.where(mask_BT, x_BT, zeros_BT).sum() / num_valid.clamp(min=1)
    centered_BT = torch.where(mask_BT, x_BT - mean, zeros_BT)
    var = centered_BT.square().sum() / (num_valid - 1).clamp(min=1)
    whitened_BT = centered_BT * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened_BT = whitened_BT + mean
    return torch.where(mask_BT, whitened_BT, zeros_BT)
