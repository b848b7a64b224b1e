"""`ParallelDims`: the one object that validates parallelism degrees and builds every named mesh.

World = pp x dp_replicate x dp_shard x cp x tp (data parallelism dp = dp_replicate x dp_shard is
what the other degrees leave). Expert parallelism takes its ranks from dp_shard x cp x tp (no
expert-tensor parallelism: split across TP ranks the expert GEMMs get too small to run well, which
is why torchtitan dropped it), and expert weights are FSDP-sharded over what EP leaves (efsdp).

Two views of the same ranks, unflattened from one world mesh so that they share a root:
- dense  (pp, dp_replicate, dp_shard, cp, tp): attention, dense MLPs, embeddings, norms;
  FSDP shards dense parameters over dp_shard x cp ("fsdp"), HSDP adds dp_replicate.
- sparse (pp, dp_replicate, efsdp, ep): routed experts; efsdp = dp_shard x cp x tp / ep.
Rank order is row-major, tp innermost, so TP (and EP, carved from the innermost ranks) stays on
the fastest links of a node.

Everything else asks this object for a named mesh (`tp_mesh()`, `ep_mesh()`...) instead of
building process groups itself. `check_model(args)` checks the degrees against a model's shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from rlloom.models.args import ModelArgs

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
SPARSE_AXES = ("pp", "dp_replicate", "efsdp", "ep")


@dataclass(kw_only=True)
class ParallelDims:
    """Degrees of each parallelism; pp x dp_replicate x dp_shard x cp x tp must equal `world_size`.

    Examples: `ParallelDims(world_size=8)` is 8-way FSDP; `ParallelDims(world_size=8, tp=2)` is
    TP 2 x FSDP 4; `ParallelDims(world_size=8, tp=2, ep=4)` adds 4-way expert parallelism over
    (2 of the 4 FSDP ranks) x (the 2 TP ranks).
    """

    world_size: int
    """Number of processes (ranks) taking part."""
    tp: int = 1
    """Tensor-parallel degree (with sequence parallelism for the norms)."""
    pp: int = 1
    """Pipeline-parallel degree."""
    cp: int = 1
    """Context-parallel degree."""
    ep: int = 1
    """Expert-parallel degree: must divide dp_shard x cp x tp."""
    dp_replicate: int = 1
    """Replicas of the sharded model (HSDP when > 1)."""
    dp_shard: int = -1
    """FSDP sharding degree; -1 means what world_size leaves after every other degree."""
    _meshes: dict[str, DeviceMesh] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "pp", "cp", "ep", "dp_replicate"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"parallel.{name}={getattr(self, name)} is invalid: must be >= 1. "
                    f"Fix: use 1 to turn it off.{self._factors()}"
                )
        others = self.pp * self.dp_replicate * self.cp * self.tp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise ValueError(
                    f"world size {self.world_size} is not divisible by pp x dp_replicate x cp x tp = "
                    f"{self.pp} x {self.dp_replicate} x {self.cp} x {self.tp} = {others}, so no data-parallel "
                    f"degree fits (rule: world = pp x dp x cp x tp). Fix: use {others * _ceil(self.world_size, others)} "
                    f"workers or degrees whose product divides {self.world_size}.{self._factors()}"
                )
            self.dp_shard = self.world_size // others
        if self.dp_shard < 1:
            raise ValueError(
                f"dp_shard={self.dp_shard} is invalid: must be >= 1 or -1 (inferred). Fix: use -1."
            )
        if self.dp_shard * others != self.world_size:
            raise ValueError(
                f"parallel degrees multiply to {self.dp_shard * others}, not the world size {self.world_size} "
                f"(rule: world = pp x dp_replicate x dp_shard x cp x tp). Fix: change a degree or leave "
                f"dp_shard=-1 to infer it.{self._factors()}"
            )
        if self.ep_pool % self.ep:
            raise ValueError(
                f"parallel.ep={self.ep} does not divide dp_shard x cp x tp = {self.dp_shard} x {self.cp} x "
                f"{self.tp} = {self.ep_pool}, the ranks expert parallelism borrows (rule: no ranks of pp or "
                f"dp_replicate). Fix: use an ep that divides {self.ep_pool}.{self._factors()}"
            )

    def _factors(self) -> str:
        return (
            f" (world={self.world_size}: pp={self.pp}, dp_replicate={self.dp_replicate}, "
            f"dp_shard={self.dp_shard}, cp={self.cp}, tp={self.tp}; ep={self.ep})"
        )

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: how many different slices of the batch are processed at once."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_enabled(self) -> bool:
        return self.dp_size > 1

    @property
    def fsdp_size(self) -> int:
        """Ranks dense parameters are sharded over: dp_shard x cp."""
        return self.dp_shard * self.cp

    @property
    def ep_pool(self) -> int:
        """Ranks expert parallelism may borrow: dp_shard x cp x tp."""
        return self.dp_shard * self.cp * self.tp

    @property
    def efsdp(self) -> int:
        """Ranks each expert's weights are FSDP-sharded over: what EP leaves of dp_shard x cp x tp."""
        return self.ep_pool // self.ep

    def degrees(self) -> dict[str, int]:
        """Every degree by name, dense axes outermost first, then ep."""
        return {**{axis: getattr(self, axis) for axis in AXES}, "ep": self.ep}

    def check_model(self, args: ModelArgs) -> None:
        """ValueError naming the first model shape the degrees do not divide."""
        rules = [
            ("tp", self.tp, "num_attention_heads", args.num_heads),
            ("tp", self.tp, "vocab_size", args.vocab_size),
        ]
        if args.mla is None:
            rules.append(("tp", self.tp, "num_key_value_heads", args.num_kv_heads))
        dense_layers = args.num_layers - (len(args.moe.sparse_layers) if args.moe is not None else 0)
        if dense_layers:
            rules.append(("tp", self.tp, "intermediate_size", args.intermediate_size))
        if args.moe is not None:
            rules.append(("ep", self.ep, "num_experts", args.moe.num_experts))
        elif self.ep > 1:
            raise ValueError(
                f"parallel.ep={self.ep} needs a mixture-of-experts model, but {args.model_type} has no "
                f"experts. Fix: set parallel.ep=1.{self._factors()}"
            )
        for degree_name, degree, field_name, value in rules:
            if value % degree:
                raise ValueError(
                    f"parallel.{degree_name}={degree} does not divide the model's {field_name}={value} "
                    f"({args.model_type}; each {degree_name} rank holds an equal share). Fix: use a "
                    f"parallel.{degree_name} that divides {value}.{self._factors()}"
                )
        if args.num_layers < self.pp:
            raise ValueError(
                f"parallel.pp={self.pp} is larger than the model's num_hidden_layers={args.num_layers} "
                f"(each stage needs a layer). Fix: use parallel.pp <= {args.num_layers}.{self._factors()}"
            )

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Build the dense and sparse meshes and every named submesh; returns the dense mesh.

        Needs an initialised default process group (see `rlloom.parallel.distributed`) whose size is
        `world_size`. Degree-1 axes are built too, so every name always resolves.
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
        world = init_device_mesh(device_type, (self.world_size,), mesh_dim_names=("world",))
        dense = world._unflatten(0, tuple(getattr(self, a) for a in AXES), AXES)
        fsdp = world._unflatten(
            0, (self.pp, self.dp_replicate, self.fsdp_size, self.tp), ("pp", "dp_replicate", "fsdp", "tp")
        )
        sparse = world._unflatten(0, (self.pp, self.dp_replicate, self.efsdp, self.ep), SPARSE_AXES)
        m = {"dense": dense, "sparse": sparse}
        m.update({axis: dense[axis] for axis in AXES})
        m["fsdp"] = fsdp["dp_replicate", "fsdp"] if self.dp_replicate > 1 else fsdp["fsdp"]
        m["dp"] = dense["dp_replicate", "dp_shard"]._flatten("dp")
        m["loss"] = dense["dp_replicate", "dp_shard", "cp"]._flatten("loss")
        m["tokens"] = dense["dp_replicate", "dp_shard", "cp", "tp"]._flatten("tokens")
        m["ep"], m["efsdp"] = sparse["ep"], sparse["efsdp"]
        m["efsdp_hsdp"] = sparse["dp_replicate", "efsdp"] if self.dp_replicate > 1 else sparse["efsdp"]
        self._meshes = m
        return dense

    def _get(self, name: str) -> DeviceMesh:
        if not self._meshes:
            raise ValueError(
                f"ParallelDims mesh {name!r} is not built yet. Fix: call build_mesh(device_type) first."
            )
        return self._meshes[name]

    @property
    def mesh(self) -> DeviceMesh:
        """The dense mesh (pp, dp_replicate, dp_shard, cp, tp)."""
        return self._get("dense")

    def sparse_mesh(self) -> DeviceMesh:
        """The expert mesh (pp, dp_replicate, efsdp, ep)."""
        return self._get("sparse")

    def dp_shard_mesh(self) -> DeviceMesh:
        """What FSDP shards dense parameters over: dp_shard x cp flattened ("fsdp"), preceded by
        dp_replicate for HSDP (2-D)."""
        return self._get("fsdp")

    def dp_mesh(self) -> DeviceMesh:
        """All data-parallel ranks (dp_replicate x dp_shard) as one 1-D mesh: batch splitting."""
        return self._get("dp")

    def loss_mesh(self) -> DeviceMesh:
        """dp x cp as one 1-D mesh: the ranks whose token and sequence counts make the global batch."""
        return self._get("loss")

    def token_mesh(self) -> DeviceMesh:
        """dp x cp x tp as one 1-D mesh: the ranks of one pipeline stage, whose token shards make the
        global batch when every TP rank routes its own shard (expert parallelism over TP ranks)."""
        return self._get("tokens")

    def tp_mesh(self) -> DeviceMesh:
        return self._get("tp")

    def cp_mesh(self) -> DeviceMesh:
        return self._get("cp")

    def pp_mesh(self) -> DeviceMesh:
        return self._get("pp")

    def ep_mesh(self) -> DeviceMesh:
        """The ranks that split the routed experts between them."""
        return self._get("ep")

    def efsdp_mesh(self) -> DeviceMesh:
        """What FSDP shards expert weights over (dp_replicate x efsdp for HSDP, else efsdp)."""
        return self._get("efsdp_hsdp")


def _ceil(a: int, b: int) -> int:
    return -(-a // b)
