"""Reductions over the valid (masked-in) tokens of a [B, T] tensor that never divide by zero.

Shape legend: B sequences, T response tokens; a mask is bool [B, T], true where a token counts.
"""

from __future__ import annotations

import torch


def masked_sum(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Scalar sum of x over valid tokens (torch.where, so masked values never reach the result)."""
    return torch.where(mask_BT, x_BT, torch.zeros_like(x_BT)).sum()


def masked_mean(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Scalar mean of x over valid tokens; 0 when no token is valid."""
    num_valid = mask_BT.sum().clamp(min=1).to(x_BT.dtype)
    return masked_sum(x_BT, mask_BT) / num_valid


def masked_frac(cond_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Scalar fraction of valid tokens where the bool `cond_BT` holds; 0 when no token is valid."""
    return masked_mean(cond_BT.to(torch.float32), mask_BT)
