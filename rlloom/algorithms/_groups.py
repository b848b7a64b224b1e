"""Vectorised per-group statistics over a batch (a group = the samples of one prompt).

Shape legend: B samples in the batch, G distinct groups in the batch.
"""

from __future__ import annotations

import torch


def group_index(group_ids_B: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Map arbitrary integer group ids to 0..G-1: returns (index_B, G)."""
    unique_G, index_B = torch.unique(group_ids_B, return_inverse=True)
    return index_B, int(unique_G.numel())


def group_sum(x_B: torch.Tensor, index_B: torch.Tensor, num_groups: int) -> torch.Tensor:
    """[G] sum of `x_B` within each group (index_add over groups, no Python loop)."""
    return torch.zeros(num_groups, dtype=x_B.dtype, device=x_B.device).index_add(0, index_B, x_B)


def group_count(index_B: torch.Tensor, num_groups: int, dtype: torch.dtype) -> torch.Tensor:
    """[G] number of samples in each group, as `dtype`."""
    ones_B = torch.ones(index_B.shape, dtype=dtype, device=index_B.device)
    return group_sum(ones_B, index_B, num_groups)


def group_centered(x_B: torch.Tensor, group_ids_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_B minus its group mean, group size of each sample [B]); both in x_B's dtype."""
    index_B, num_groups = group_index(group_ids_B)
    count_G = group_count(index_B, num_groups, x_B.dtype)
    mean_G = group_sum(x_B, index_B, num_groups) / count_G
    return x_B - mean_G[index_B], count_G[index_B]
