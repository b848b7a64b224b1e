"""`ParallelDims`: the one object that validates parallelism degrees and builds the device mesh.

Everything else asks it for a named submesh (`dp_mesh`, later `tp_mesh`...) instead of building
process groups itself. Mesh axes, outermost first: pp, dp_replicate, dp_shard, cp, tp. Today the
training engine implements data parallelism (FSDP over dp_shard, HSDP when dp_replicate > 1); the
other degrees are validated here so that tensor, context and pipeline parallelism slot in as
`apply_tp` / `apply_cp` / pipeline stages without changing this object's interface.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(kw_only=True)
class ParallelDims:
    """Degrees of each parallelism; their product must equal `world_size`.

    Example: `ParallelDims(world_size=8)` is 8-way FSDP; `ParallelDims(dp_replicate=2, dp_shard=4,
    world_size=8)` is HSDP (replicas of 4-way sharded models).
    """

    world_size: int
    """Number of processes (ranks) taking part."""
    dp_shard: int = -1
    """FSDP sharding degree; -1 means world_size divided by every other degree."""
    dp_replicate: int = 1
    """Replicas of the sharded model (HSDP when > 1)."""
    tp: int = 1
    """Tensor-parallel degree."""
    cp: int = 1
    """Context-parallel degree."""
    pp: int = 1
    """Pipeline-parallel degree."""
    _mesh: DeviceMesh | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(
                f"world_size={self.world_size} is invalid: must be >= 1. Fix: pass the number of ranks."
            )
        for name in ("dp_replicate", "tp", "cp", "pp"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(
                    f"parallel degree {name}={value} is invalid: must be >= 1. Fix: use 1 to disable it."
                )
        others = self.dp_replicate * self.tp * self.cp * self.pp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise ValueError(
                    f"cannot infer dp_shard: world_size={self.world_size} is not divisible by dp_replicate * tp * cp * pp "
                    f"= {self.dp_replicate} * {self.tp} * {self.cp} * {self.pp} = {others}. Fix: pick degrees whose "
                    "product divides the world size."
                )
            self.dp_shard = self.world_size // others
        if self.dp_shard < 1:
            raise ValueError(f"dp_shard={self.dp_shard} is invalid: must be >= 1 or -1 (infer). Fix: use -1.")
        product = self.dp_shard * others
        if product != self.world_size:
            raise ValueError(
                f"parallel degrees do not multiply to the world size: pp {self.pp} * dp_replicate {self.dp_replicate} * "
                f"dp_shard {self.dp_shard} * cp {self.cp} * tp {self.tp} = {product}, but world_size={self.world_size}. "
                "Fix: change a degree, or set dp_shard=-1 to infer it."
            )

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: how many different slices of the batch are processed at once."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_enabled(self) -> bool:
        return self.dp_size > 1

    def degrees(self) -> dict[str, int]:
        """Every axis with its degree, outermost first."""
        return {axis: getattr(self, axis) for axis in AXES}

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Build the world mesh over every axis (degree-1 axes included, so names always resolve).

        Needs an initialised default process group (see `rlloom.parallel.distributed`).
        """
        if not dist.is_initialized():
            raise ValueError(
                "ParallelDims.build_mesh needs torch.distributed to be initialised. Fix: call "
                "rlloom.parallel.distributed.init_distributed() first."
            )
        if dist.get_world_size() != self.world_size:
            raise ValueError(
                f"ParallelDims(world_size={self.world_size}) does not match the process group's world size "
                f"{dist.get_world_size()}. Fix: build ParallelDims with world_size=torch.distributed.get_world_size()."
            )
        shape = tuple(getattr(self, axis) for axis in AXES)
        self._mesh = init_device_mesh(device_type, shape, mesh_dim_names=AXES)
        return self._mesh

    @property
    def mesh(self) -> DeviceMesh:
        if self._mesh is None:
            raise ValueError("ParallelDims.mesh is not built yet. Fix: call build_mesh(device_type) first.")
        return self._mesh

    def dp_shard_mesh(self) -> DeviceMesh:
        """The mesh FSDP shards over: 1-D (dp_shard), or 2-D (dp_replicate, dp_shard) for HSDP."""
        if self.dp_replicate > 1:
            return self.mesh["dp_replicate", "dp_shard"]
        return self.mesh["dp_shard"]

    def dp_mesh(self) -> DeviceMesh:
        """All data-parallel ranks as one 1-D mesh (for batch splitting and metric reductions)."""
        if self.dp_replicate > 1:
            return self.mesh["dp_replicate", "dp_shard"]._flatten("dp")
        return self.mesh["dp_shard"]
