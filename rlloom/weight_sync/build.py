"""Which weight-sync transport a run uses: `sync.transport`, with `auto` resolved from the placement
(`TRANSPORT_OF_PLACEMENT`: colocated ranks copy in place, a separate rollout pool is sent to by
broadcast). The cluster asks `transport(cfg)` and runs that transport; a new transport is a file
here and one branch where the cluster runs it."""

from __future__ import annotations

from typing import Literal

from rlloom.config import RunConfig
from rlloom.config.sync import TRANSPORT_OF_PLACEMENT

Transport = Literal["inplace", "broadcast"]


def transport(cfg: RunConfig) -> Transport:
    """The run's transport (the config refused one its placement cannot run)."""
    chosen = (
        TRANSPORT_OF_PLACEMENT[cfg.cluster.placement] if cfg.sync.transport == "auto" else cfg.sync.transport
    )
    return chosen  # type: ignore[return-value]
