"""Colocated, in-process weight sync: training engine buckets straight into the rollout engine.

The training engine yields buckets of full tensors under Hugging Face names (gathering FSDP
shards); the rollout engine copies each into its existing parameters in place, so nothing is
re-allocated and CUDA graphs stay valid. Optionally every tensor is checksummed on both sides.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from rlloom.engines.train.native.weights import tensor_checksum


class WeightSource(Protocol):
    version: int

    def named_weights(
        self, *, bucket_bytes: int, dtype: torch.dtype | None = None
    ) -> Iterator[list[tuple[str, torch.Tensor]]]: ...


class WeightSink(Protocol):
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None: ...


@dataclass(kw_only=True, slots=True)
class SyncReport:
    """What one sync moved."""

    version: int
    num_tensors: int
    num_bytes: int
    seconds: float
    checksums: dict[str, str] = field(default_factory=dict)
    """HF name -> checksum of the tensor sent (when asked for)."""

    def metrics(self) -> dict[str, float]:
        gb = self.num_bytes / 1e9
        return {
            "sync/ms": self.seconds * 1e3,
            "sync/gb": gb,
            "sync/ms_per_gb": self.seconds * 1e3 / gb if gb > 0 else 0.0,
            "sync/num_tensors": float(self.num_tensors),
        }


def sync_colocated(
    source: WeightSource,
    sink: WeightSink,
    *,
    bucket_bytes: int = 256 << 20,
    dtype: torch.dtype | None = None,
    checksum: bool = False,
) -> SyncReport:
    """Push the source's current weights (cast to `dtype`) into the sink under the source's version."""
    start = time.perf_counter()
    report = SyncReport(version=source.version, num_tensors=0, num_bytes=0, seconds=0.0)
    seen: set[str] = set()
    for bucket in source.named_weights(bucket_bytes=bucket_bytes, dtype=dtype):
        for name, tensor in bucket:
            if name in seen:
                raise RuntimeError(f"weight sync: tensor {name!r} was sent twice in one sync")
            seen.add(name)
            report.num_tensors += 1
            report.num_bytes += tensor.numel() * tensor.element_size()
            if checksum:
                report.checksums[name] = tensor_checksum(tensor)
        sink.update_weights(bucket, source.version)
    report.seconds = time.perf_counter() - start
    return report
