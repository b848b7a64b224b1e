"""What every weight-sync transport shares: the source protocol (the sink is a rollout engine,
`RolloutEngine`), the report of one sync, the error a failed sync raises, and whether content
checksums run (`sync.checksum`)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch


class WeightSource(Protocol):
    """The training side: a training engine (`TrainEngine.named_weights`)."""

    version: int

    def named_weights(
        self,
        *,
        bucket_bytes: int,
        dtype: torch.dtype | None = None,
        owned_only: bool = False,
        lazy_cast: bool = False,
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Buckets of (Hugging Face name, full tensor); `owned_only`: only what this rank holds without
        an all-gather over the expert- or tensor-parallel ranks (its routed experts, its TP shard of a
        tensor-parallel tensor; the broadcast sync's senders, with `broadcast.owner_layout`).
        `lazy_cast`: a tensor that no gather moves (one rank's, or one process's) comes in its own
        dtype, for a caller whose copy casts it (the weight syncs): one pass instead of a cast and a copy."""
        ...


class WeightSyncError(RuntimeError):
    """A sync failed (missing or duplicate tensor, wrong shape or version, checksum mismatch,
    timeout, a failed peer); the message says which, and whether the rollout kept its previous version."""


@dataclass(kw_only=True, slots=True)
class SyncReport:
    """What one sync moved, seen from one rank. Example: `SyncReport(version=3, num_tensors=290,
    num_bytes=270_000_000, seconds=0.05)`."""

    version: int
    """The policy version the sync carried."""
    num_tensors: int
    """Tensors (or slices of tensors) this rank sent or received."""
    num_bytes: int
    """Bytes this rank sent or received."""
    seconds: float
    """Wall time of the whole sync on this rank, verification included."""
    checksums: dict[str, str] = field(default_factory=dict)
    """Tensor (or slice) key -> content checksum, when checksums ran."""

    def metrics(self) -> dict[str, float]:
        gb = self.num_bytes / 1e9
        return {
            "sync/ms": self.seconds * 1e3,
            "sync/gb": gb,
            "sync/ms_per_gb": self.seconds * 1e3 / gb if gb > 0 else 0.0,
            "sync/num_tensors": float(self.num_tensors),
        }


def checksum_enabled(mode: Literal["auto", "always", "never"], device: torch.device) -> bool:
    """`sync.checksum` resolved for weights on `device`: auto = on CPU, off on GPU."""
    return mode == "always" or (mode == "auto" and device.type == "cpu")
