"""DAPO batch shaping (Yu et al. 2025): dynamic sampling filter and soft overlong punishment.

Shape legend: B samples in the batch.
"""

from __future__ import annotations

import torch

from rlloom.algorithms._groups import group_index
from rlloom.algorithms._validate import check_group_ids, float_input


def keep_informative_groups(rewards_B: torch.Tensor, group_ids_B: torch.Tensor) -> torch.Tensor:
    """DAPO dynamic sampling: keep only samples whose group has at least two different rewards.

    A group whose rewards are all equal (all correct or all wrong) has zero group-relative advantage
    and contributes no gradient. Rewards are compared exactly (group max == group min): rule rewards
    are discrete, and a tolerance would silently drop groups of distinct learned rewards. A group of
    one sample is dropped too.

    rewards_B: [B]. group_ids_B: [B] integer. Returns keep_B: [B] bool.
    """
    rewards_B = float_input("rewards_B", rewards_B, ndim=1)
    group_ids_B = check_group_ids(group_ids_B, rewards_B.numel())
    index_B, num_groups = group_index(group_ids_B)
    max_G = torch.full((num_groups,), -torch.inf, dtype=rewards_B.dtype, device=rewards_B.device)
    max_G = max_G.scatter_reduce(0, index_B, rewards_B, reduce="amax")
    min_G = torch.full((num_groups,), torch.inf, dtype=rewards_B.dtype, device=rewards_B.device)
    min_G = min_G.scatter_reduce(0, index_B, rewards_B, reduce="amin")
    return (max_G != min_G)[index_B]


def overlong_penalty(
    lengths_B: torch.Tensor, *, max_len: int, buffer_len: int, factor: float
) -> torch.Tensor:
    """DAPO soft overlong punishment, added to the reward of each sample.

    With L = response length and start = max_len - buffer_len:
      0                                  if L <= start
      -factor * (L - start) / buffer_len if start < L <= max_len   (linear down to -factor)
      -factor                            if L > max_len
    buffer_len = 0 turns the shaping off (all zeros), matching `algorithm.overlong_buffer = 0`.

    lengths_B: [B] response lengths (integer or float, >= 0). max_len: >= 1. buffer_len: in
    [0, max_len]. factor: >= 0. Returns penalty_B: [B] float, <= 0.
    """
    lengths_B = float_input("lengths_B", lengths_B, ndim=1)
    if bool((lengths_B < 0).any()):
        raise ValueError("lengths_B has negative entries; lengths must be >= 0. Fix: pass token counts.")
    if not max_len >= 1:
        raise ValueError(f"max_len={max_len!r} must be >= 1. Fix: use rollout.max_new_tokens.")
    if not 0 <= buffer_len <= max_len:
        raise ValueError(
            f"buffer_len={buffer_len!r} must be in [0, max_len={max_len}]. Fix: use e.g. max_len // 4."
        )
    if not factor >= 0:
        raise ValueError(f"factor={factor!r} must be >= 0 (the penalty at max_len is -factor). Fix: use 1.0.")
    if buffer_len == 0:
        return torch.zeros_like(lengths_B)
    start = max_len - buffer_len
    return -factor * ((lengths_B - start) / buffer_len).clamp(0.0, 1.0)
