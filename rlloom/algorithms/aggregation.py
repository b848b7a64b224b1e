"""Reduce per-token losses [B, T] to the step loss, split so micro-batching stays exact.

Shape legend: B sequences, T response tokens; a mask is bool or 0/1 [B, T], true where a token
is trained on.

Every mode is `numerator / normalizer`. The numerator is a sum over sequences, so it can be
computed on any slice of the batch (a micro-batch, a data-parallel rank) and summed; the
normalizer depends only on the mask of the GLOBAL batch. The training engine therefore does

    loss = sum over micro-batches of aggregate_loss_sum(loss_slice, mask_slice, mode)
           / loss_normalizer(mask_global, mode, norm_constant=...)

and gets the same value and gradients as `aggregate_loss` on the whole batch at once.

Modes (valid sequence = a sequence with at least one valid token):
- "token-mean": sum over valid tokens / number of valid tokens (DAPO token-level loss).
- "token-sum": sum over valid tokens.
- "seq-mean-token-sum": sum over valid tokens / number of valid sequences.
- "seq-mean-token-mean": mean over valid sequences of each sequence's token mean (original GRPO).
- "seq-mean-token-sum-norm": sum over valid tokens / (valid sequences x norm_constant), with
  norm_constant defaulting to T (Dr.GRPO, Liu et al. 2025: a constant instead of the length).
An all-masked batch gives 0, never NaN.
"""

from __future__ import annotations

import torch

from rlloom.algorithms._masked import masked_sum
from rlloom.algorithms._validate import bool_mask, check_positive, float_input

AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def _check_mode(mode: str) -> None:
    if mode not in AGG_MODES:
        raise ValueError(f"mode={mode!r} is not an aggregation mode; valid modes are {', '.join(AGG_MODES)}.")


def loss_normalizer(mask_BT: torch.Tensor, mode: str, *, norm_constant: float | None = None) -> float:
    """Denominator of `mode` for the GLOBAL batch (never 0: 1 when nothing is valid).

    token-mean: valid tokens; token-sum: 1; seq-mean-token-sum and seq-mean-token-mean: valid
    sequences; seq-mean-token-sum-norm: valid sequences x norm_constant (default T = mask width).
    norm_constant (> 0) is read only by seq-mean-token-sum-norm, so an engine may always pass it.

    mask_BT: [B, T] bool or 0/1 of the whole batch. Returns a Python float >= 1 (or >= norm_constant).
    """
    _check_mode(mode)
    if not isinstance(mask_BT, torch.Tensor) or mask_BT.dim() != 2:
        shape = tuple(mask_BT.shape) if isinstance(mask_BT, torch.Tensor) else type(mask_BT).__name__
        raise ValueError(
            f"mask_BT has shape {shape} but must be [B, T]. Fix: pass the batch's response mask."
        )
    mask_BT = bool_mask("mask_BT", mask_BT, mask_BT.shape, "mask_BT")
    if norm_constant is not None:
        check_positive("norm_constant", norm_constant)
    if mode == "token-sum":
        return 1.0
    if mode == "token-mean":
        return float(max(int(mask_BT.sum()), 1))
    num_valid_seqs = float(max(int(mask_BT.any(dim=1).sum()), 1))
    if mode == "seq-mean-token-sum-norm":
        return num_valid_seqs * float(norm_constant if norm_constant is not None else mask_BT.shape[1])
    return num_valid_seqs


def aggregate_loss_sum(loss_BT: torch.Tensor, mask_BT: torch.Tensor, mode: str) -> torch.Tensor:
    """Numerator of `mode` for any slice of rows of the batch (sums over slices add up).

    seq-mean-token-mean: sum over sequences of (sum over its valid tokens / its valid token count);
    every other mode: sum over valid tokens. Masked values never enter (torch.where, not multiply).

    loss_BT: [B, T] per-token loss. mask_BT: [B, T] bool or 0/1. Returns a scalar tensor.
    """
    _check_mode(mode)
    loss_BT = float_input("loss_BT", loss_BT, ndim=2)
    mask_BT = bool_mask("mask_BT", mask_BT, loss_BT.shape, "loss_BT")
    if mode != "seq-mean-token-mean":
        return masked_sum(loss_BT, mask_BT)
    row_sum_B = torch.where(mask_BT, loss_BT, torch.zeros_like(loss_BT)).sum(dim=1)
    row_count_B = mask_BT.sum(dim=1).clamp(min=1).to(loss_BT.dtype)
    return (row_sum_B / row_count_B).sum()


def aggregate_loss(
    loss_BT: torch.Tensor, mask_BT: torch.Tensor, mode: str, *, norm_constant: float | None = None
) -> torch.Tensor:
    """The step loss of a whole batch: aggregate_loss_sum(loss, mask) / loss_normalizer(mask).

    loss_BT: [B, T]. mask_BT: [B, T] bool or 0/1. mode: one of AGG_MODES. Returns a scalar tensor.
    """
    numerator = aggregate_loss_sum(loss_BT, mask_BT, mode)
    return numerator / loss_normalizer(mask_BT, mode, norm_constant=norm_constant)
