"""The `sync` section: how the weights travel from training to the rollout engines."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlloom.config.checks import check, check_finite

TRANSPORT_OF_PLACEMENT = {"colocated": "inplace", "separate": "broadcast"}
"""The one weight-sync transport each cluster.placement can run (what sync.transport=auto picks):
colocated ranks share a process with their training rank, separate pools share none."""


@dataclass(kw_only=True, slots=True)
class SyncConfig:
    bucket_mb: int = 256
    """Weight-sync bucket size in MiB: tensors travel in flat buffers of at most this size (a larger
    tensor travels alone). Bigger buckets mean fewer transfers and more memory held per transfer."""
    checksum: Literal["auto", "always", "never"] = "auto"
    """Compare a content checksum of every tensor sent and received on each sync: `auto` = on when
    the weights are on CPU, off on GPU (it copies every tensor to the host); `always`; `never`. The
    structural check (every rollout tensor received exactly once, right shape, right version) always runs."""
    transport: Literal["auto", "inplace", "broadcast"] = "auto"
    """How the weights travel (rlloom/weight_sync/): `inplace`, copied inside each process that holds
    a training and a rollout rank (cluster.placement=colocated); `broadcast`, sent by every training
    rank over a sync group to a separate rollout pool (cluster.placement=separate); `auto` picks the
    one the placement runs."""
    timeout_s: float = 300.0
    """Longest wait for one weight sync between separate training and rollout workers; on timeout the
    rollout keeps its previous weights and version and the sync raises."""

    def __post_init__(self) -> None:
        check_finite(self, "sync")
        check(self.bucket_mb >= 1, "sync.bucket_mb", self.bucket_mb, "must be >= 1 (MiB)", "use e.g. 256")
        check(self.timeout_s > 0, "sync.timeout_s", self.timeout_s, "must be > 0 seconds", "use e.g. 300")
