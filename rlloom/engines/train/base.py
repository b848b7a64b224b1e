"""The interface every training engine implements (the loss callback it takes is
`rlloom.algorithms.objective.LossFn`), and `WeightLayout`, the record of where each exported
tensor lives that the broadcast weight sync plans from.

The controller talks to a training engine only through these methods; engines are chosen with a
plain `if` at build time. Shape legend: B samples of the global batch, b of one micro-batch, T
response tokens (the batch's `T`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from torch.distributed.tensor import Placement

from rlloom.algorithms.objective import LossFn
from rlloom.data.types import RolloutBatch


@dataclass(frozen=True, slots=True)
class WeightLayout:
    """Where one Hugging Face tensor lives in the training layout (for an owner-only reshard plan)."""

    native_name: str
    """The native parameter it comes from (e.g. `layers.1.moe.experts.w1`)."""
    shape: tuple[int, ...]
    """The full shape of the Hugging Face tensor."""
    expert: int | None
    """For a routed expert: its index in the native [E, ...] stack (the HF tensor is that row)."""
    ep_rank: int | None
    """For a routed expert under expert parallelism: the EP rank holding it (None: every rank)."""
    mesh_dim_names: tuple[str, ...]
    """Mesh dimensions of this rank's native DTensor (empty for a plain tensor)."""
    placements: tuple[Placement, ...]
    """Its placements on those dimensions (Shard(0) over "fsdp" and Shard(d) / Replicate over "tp",
    ...); an expert's are those of its EP rank's [E / ep, ...] block."""
    tp_shard: tuple[int, int] | None = None
    """(dim d, tp) when `named_weights(owned_only=True)` yields only this rank's tensor-parallel shard
    of it: `torch.chunk(full, tp, d)[tp_rank]`; None: it yields the tensor whole."""


@dataclass(frozen=True, slots=True)
class ForwardOptions:
    """How a training forward scores the response tokens: one record from the engine's entry points
    down to the head, in place of the same keywords at every level."""

    temperature: float = 1.0
    """Divides the logits: the rollout's sampling temperature, so both score the same policy."""
    with_entropy: bool = False
    """Also compute each response token's entropy (the loss's entropy term and metrics)."""
    routing_replay: bool = False
    """An MoE model routes each token to the experts the rollout recorded (algorithm.routing_replay)."""


PLAIN_FORWARD = ForwardOptions()
"""Temperature 1, no entropy, the model's own routing (the engine methods' default)."""


class TrainEngine(Protocol):
    """What the controller may call on a training engine (all data-parallel ranks call each one)."""

    version: int
    """Optimizer steps applied: the policy version of the current weights."""

    @property
    def ep_rank(self) -> int:
        """This rank's expert-parallel rank (0 without expert parallelism)."""
        ...

    @property
    def tp_rank(self) -> int:
        """This rank's tensor-parallel rank (0 without tensor parallelism)."""
        ...

    def forward_logprobs(
        self, batch: RolloutBatch, options: ForwardOptions = PLAIN_FORWARD
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """fp32 [B, T] logprobs (and entropies) of the response tokens, 0 where masked."""
        ...

    def forward_values(self, batch: RolloutBatch) -> torch.Tensor:
        """A critic's (a value-head engine's) fp32 [B, T] values before each response token, 0 where masked."""
        ...

    def train_step(
        self,
        batch: RolloutBatch,
        loss_fn: LossFn,
        *,
        loss_normalizer: float,
        options: ForwardOptions = PLAIN_FORWARD,
    ) -> dict[str, float]:
        """One optimizer step on the global batch; loss = sum of loss_fn sums / loss_normalizer."""
        ...

    def named_weights(
        self,
        *,
        bucket_bytes: int = 1 << 29,
        dtype: torch.dtype | None = None,
        owned_only: bool = False,
        lazy_cast: bool = False,
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Buckets of (Hugging Face name, full tensor) for weight sync. `owned_only`: only what this
        rank holds without gathering over the expert- or tensor-parallel ranks (its own routed
        experts, its TP shard of each tensor-parallel tensor, as `weight_layouts` describes).
        `lazy_cast`: a tensor that no gather moves (one rank's, or one process's) comes in its own
        dtype, for a caller whose copy casts it (the weight syncs): one pass instead of a cast and a copy."""
        ...

    def weight_layouts(self) -> dict[str, WeightLayout]:
        """For each Hugging Face name `named_weights` yields, where it lives on this rank (full shape,
        expert index and EP owner, TP shard); no data moves. The broadcast sync plans from it."""
        ...

    def save(self, path: str) -> None: ...

    def load(self, path: str) -> None: ...

    def offload(self) -> None:
        """Move parameters, gradients and optimizer state to CPU."""
        ...

    def onload(self) -> None:
        """Undo `offload`."""
        ...
