"""The supervised fine-tuning objective as the training engine calls it: negative log-likelihood of
the masked (assistant) tokens.

`rlloom sft` trains the policy engine that RL trains, with this loss in place of the policy loss:
the engine packs the rows into micro-batches of its token budget, calls the loss per micro-batch
with the rows it holds, and divides each micro-batch's sum by the normaliser of the whole step's
batch (`sft_normalizer`), so the step loss is exact under any micro-batching and data-parallel
layout. Shape legend: B rows of the step's batch, b of a micro-batch, T response tokens (the tokens
after each row's first assistant turn begins; the mask picks the assistant tokens among them).
"""

from __future__ import annotations

import torch

from rlloom.algorithms.aggregation import aggregate_loss_sum, loss_normalizer
from rlloom.algorithms.objective import LossFn
from rlloom.devices import to_device
from rlloom.observability.metrics import Mean, Sum

SFT_AGG_MODES = ("token-mean", "seq-mean-token-mean")
"""How `rlloom sft` reduces the token losses (algorithm.agg_mode): a mean over every assistant token
of the step (each token counts once), or the mean over rows of each row's token mean (each row
counts once, long answers no more than short ones)."""


def sft_normalizer(mask_BT: torch.Tensor, agg_mode: str) -> float:
    """The step's loss normaliser: its assistant tokens (token-mean) or its rows (seq-mean-token-mean)."""
    return loss_normalizer(mask_BT, agg_mode)


def make_sft_loss_fn(mask_BT: torch.Tensor, agg_mode: str) -> LossFn:
    """The per-micro-batch loss: the sum (`aggregate_loss_sum` of `agg_mode`) of -logp over the
    micro-batch's masked tokens. Metrics: `sft/loss`, the mean NLL over the assistant tokens
    (whatever `agg_mode`; weighted by tokens across micro-batches and ranks), and `sft/tokens`.

    mask_BT: [B, T] bool, the step's assistant-token mask (`RolloutBatch.response_mask()`)."""

    def loss_fn(
        logp_bT: torch.Tensor, entropy_bT: torch.Tensor | None, rows_b: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, Mean | Sum]]:
        mask_bT = to_device(mask_BT[rows_b.to("cpu")], logp_bT.device)
        nll_bT = -logp_bT
        count = mask_bT.sum()
        with torch.no_grad():
            mean_nll = torch.where(mask_bT, nll_bT, 0.0).sum() / count.clamp(min=1)
        metrics = {"sft/loss": Mean(mean_nll, weight=count), "sft/tokens": Sum(count)}
        return aggregate_loss_sum(nll_bT, mask_bT, agg_mode), metrics

    return loss_fn
