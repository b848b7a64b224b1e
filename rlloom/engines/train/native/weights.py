"""Weight export for weight sync: full tensors under Hugging Face names, in size-bounded buckets.

Sharded (FSDP, TP) parameters are gathered with `DTensor.full_tensor()`, and expert-parallel expert
weights with an all-gather over the EP ranks: collectives, so every rank must iterate the generator
to the end in the same order. With `owned_only` (the broadcast weight sync, where every training
rank sends what it holds) nothing is gathered over the EP or TP ranks:
- each rank yields only its own routed experts, under their global Hugging Face names;
- a tensor-parallel shard (a DTensor with Shard(d) on the "tp" mesh dim: column-parallel q/k/v,
  gate/up, the vocabulary-parallel embedding and head on dim 0, row-parallel o/down on dim 1) is
  gathered over its other mesh dims only (FSDP; `parallel.tp_shard.tp_local`) and yielded as this rank's
  TP shard, under the tensor's Hugging Face name: `torch.chunk(full, tp, d)[tp_rank]` (`tp_shard`
  says which); under pipeline parallelism `Pipeline.full_weights(tp_local_shards=True)` broadcasts
  each stage's TP shards over the pp group (whose ranks share a tp rank);
- every other tensor (replicated over TP: norms, biases of row-parallel projections, MLA's q_a/kv_a,
  routers) whole, gathered over FSDP.
The FSDP gathers still run, in the same order on every rank. A TP shard is one box of one Hugging
Face tensor because training keeps one native tensor per Hugging Face tensor (separate q/k/v and
gate/up projections: `apply_tp` refuses fused ones; the adapter renames, never transposes or
splits them); a stacked expert tensor, which would split into several, is never TP-sharded (the
MoE layer's parameters stay replicated over TP). `weight_layouts` describes where each Hugging
Face tensor lives in the training layout (shape, expert index, owning EP rank, TP shard) without
moving any data.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Placement

from rlloom.engines.train.base import WeightLayout
from rlloom.engines.train.native.checkpoint import EXPERTS
from rlloom.models.adapter import StateDictAdapter
from rlloom.models.lora import LORA_PARAMS
from rlloom.parallel.tp_shard import exported, tp_shard_of


def weight_layouts(model: nn.Module, ep: int = 1) -> dict[str, WeightLayout]:
    """For each Hugging Face name of `model` (as `named_weight_buckets` yields them), its layout."""
    adapter = StateDictAdapter(model.args)
    out: dict[str, WeightLayout] = {}
    for native_name, tensor in model.state_dict().items():
        if native_name.endswith(LORA_PARAMS):  # exported merged into their weight (`lora.merged_state`)
            continue
        mesh_dims: tuple[str, ...] = ()
        placements: tuple[Placement, ...] = ()
        if isinstance(tensor, DTensor):
            mesh_dims, placements = tuple(tensor.device_mesh.mesh_dim_names or ()), tuple(tensor.placements)
        split = ep if EXPERTS in f".{native_name}" else 1
        meta = torch.empty(
            (tensor.shape[0] * split, *tensor.shape[1:]) if tensor.dim() else (), device="meta"
        )
        parts = list(adapter.to_hf(native_name, meta))
        tp_shard = tp_shard_of(tensor)
        if tp_shard is not None and len(parts) != 1:
            raise ValueError(
                f"weight_layouts: {native_name} is tensor-parallel and maps to {len(parts)} Hugging Face "
                "tensors; an owner-only export yields one TP shard per tensor. Fix: keep the model's "
                "stacked experts replicated over TP (tp.py's MoE plan)."
            )
        for index, (hf_name, part) in enumerate(parts):
            is_expert = EXPERTS in f".{native_name}"
            out[hf_name] = WeightLayout(
                native_name=native_name,
                shape=tuple(part.shape),
                expert=index if is_expert else None,
                ep_rank=index // tensor.shape[0] if is_expert and ep > 1 else None,
                mesh_dim_names=mesh_dims,
                placements=placements,
                tp_shard=tp_shard,
            )
    return out


def _gathered(
    native_name: str,
    tensor: torch.Tensor,
    ep_group: dist.ProcessGroup | None,
    owned_only: bool,
    dtype: torch.dtype | None,
    lazy_cast: bool,
) -> tuple[torch.Tensor, int]:
    """(the tensor gathered over its FSDP/TP shards, index of its first expert), cast to `dtype`
    before any gather: routed experts under expert parallelism are all-gathered over the EP ranks
    too, unless `owned_only` (then this rank's block of the stack and the global index of its first
    expert); with `owned_only` a TP-sharded tensor is gathered over its other mesh dims only and
    stays this rank's TP shard. With `lazy_cast` a tensor that nothing moves between ranks stays
    uncast (`named_weight_buckets`)."""
    expert_gather = ep_group is not None and EXPERTS in f".{native_name}"
    moves = (isinstance(tensor, DTensor) and tensor.device_mesh.size() > 1) or (
        expert_gather and not owned_only
    )
    cast = dtype if moves or not lazy_cast else None
    full = exported(tensor, tp_local_shards=owned_only, dtype=cast)  # stacked experts are never TP-sharded
    if not expert_gather:
        return full, 0
    if owned_only:
        return full, dist.get_rank(ep_group) * full.shape[0]
    blocks = [torch.empty_like(full) for _ in range(dist.get_world_size(ep_group))]
    dist.all_gather(blocks, full.contiguous(), group=ep_group)
    return torch.cat(blocks), 0


def named_weight_buckets(
    model: nn.Module,
    *,
    bucket_bytes: int,
    dtype: torch.dtype | None = None,
    ep_group: dist.ProcessGroup | None = None,
    tensors: Iterable[tuple[str, torch.Tensor]] | None = None,
    owned_only: bool = False,
    lazy_cast: bool = False,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Buckets of (hf_name, tensor) of `model` (a native CausalLM, possibly FSDP/TP-sharded; with
    `ep_group` its routed experts split over those EP ranks).

    A bucket holds at most `bucket_bytes` (a larger tensor comes alone). Tensors are cast to `dtype`
    when given (e.g. bf16 for a bf16 rollout engine; on their shards, before the gathers) and stay on
    the model's device. `tensors`:
    (native name, tensor) to export instead of `model.state_dict()` (pipeline parallelism:
    `Pipeline.full_weights(tp_local_shards=owned_only)`, every stage's weights on every pp rank).
    `owned_only`: no all-gather over the EP or TP ranks; this rank's routed experts only, and its
    shard of each TP-sharded tensor (see the module docstring). `lazy_cast`: a tensor that no gather
    moves (not sharded over several ranks, not an expert to all-gather) is yielded in its own dtype,
    a view of the parameter, for a caller that copies it into `dtype` anyway (the weight syncs: one
    pass instead of a cast and then a copy); buckets are still sized in `dtype`.
    """
    if bucket_bytes < 1:
        raise ValueError(
            f"bucket_bytes={bucket_bytes} is invalid: must be >= 1. Fix: use e.g. 512 MiB (1 << 29)."
        )
    adapter = StateDictAdapter(model.args)
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for native_name, tensor in tensors if tensors is not None else model.state_dict().items():
        full, first_expert = _gathered(native_name, tensor, ep_group, owned_only, dtype, lazy_cast)
        for hf_name, part in adapter.to_hf(native_name, full, first_expert=first_expert):
            nbytes = part.numel() * (dtype or part.dtype).itemsize
            if bucket and size + nbytes > bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append((hf_name, part))
            size += nbytes
    if bucket:
        yield bucket
