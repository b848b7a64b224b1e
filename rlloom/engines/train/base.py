"""The interface every training engine implements, and the loss callback it takes.

The controller talks to a training engine only through these methods; engines are chosen with a
plain `if` at build time. Shape legend: B samples of the global batch, b of one micro-batch, T
response tokens (the batch's `T`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import torch

from rlloom.data.types import RolloutBatch

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


class TrainEngine(Protocol):
    """What the controller may call on a training engine (all data-parallel ranks call each one)."""

    version: int
    """Optimizer steps applied: the policy version of the current weights."""

    def forward_logprobs(
        self, batch: RolloutBatch, *, temperature: float = 1.0, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """fp32 [B, T] logprobs (and entropies) of the response tokens, 0 where masked."""
        ...

    def train_step(
        self,
        batch: RolloutBatch,
        loss_fn: LossFn,
        *,
        loss_normalizer: float,
        temperature: float = 1.0,
        with_entropy: bool = False,
    ) -> dict[str, float]:
        """One optimizer step on the global batch; loss = sum of loss_fn sums / loss_normalizer."""
        ...

    def named_weights(
        self, *, bucket_bytes: int = 1 << 29, dtype: torch.dtype | None = None
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Buckets of (Hugging Face name, full tensor) for weight sync."""
        ...

    def save(self, path: str) -> None: ...

    def load(self, path: str) -> None: ...

    def offload(self) -> None:
        """Move parameters, gradients and optimizer state to CPU."""
        ...

    def onload(self) -> None:
        """Undo `offload`."""
        ...
