"""A tensor-parallel parameter's shard, for the owner-only weight export (`Pipeline.full_weights`,
`engines.train.native.weights`): which dim the "tp" mesh dim shards (`tp_shard_of`), and this
rank's TP shard gathered over the parameter's other mesh dims only, e.g. FSDP (`tp_local`, a
collective over those dims; `tp_local_shape` without moving data), and the one choice both exports
make between that shard and the full tensor (`exported`). A DTensor's Shard(d) cuts as torch.chunk
does, so the shard is `torch.chunk(full, tp, d)[tp_rank]`.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard


def tp_shard_of(tensor: torch.Tensor) -> tuple[int, int] | None:
    """(dim, tp) when `tensor` is a DTensor sharded over a "tp" mesh dim (Shard(dim) there), else None."""
    if not isinstance(tensor, DTensor) or "tp" not in (tensor.device_mesh.mesh_dim_names or ()):
        return None
    index = tensor.device_mesh.mesh_dim_names.index("tp")
    if type(tensor.placements[index]) is not Shard:  # Replicate; never a strided (FSDP-style) shard
        return None
    return tensor.placements[index].dim, tensor.device_mesh.size(index)


def tp_local(tensor: DTensor) -> torch.Tensor:
    """This rank's tensor-parallel shard of a TP-sharded `tensor` (`tp_shard_of` is not None): gathered
    over its other mesh dims only (FSDP; collective over them), `torch.chunk(full, tp, dim)[tp_rank]`."""
    tp_dim = tensor.device_mesh.mesh_dim_names.index("tp")
    others = [p if d == tp_dim else Replicate() for d, p in enumerate(tensor.placements)]
    return tensor.redistribute(tensor.device_mesh, others, async_op=False).to_local().detach()


def tp_local_shape(tensor: DTensor) -> tuple[int, ...]:
    """The shape `tp_local(tensor)` returns, without moving data."""
    dim, tp = tp_shard_of(tensor)
    full = torch.empty(tensor.shape, device="meta")
    return tuple(full.chunk(tp, dim)[tensor.device_mesh.get_local_rank("tp")].shape)


def exported(tensor: torch.Tensor, tp_local_shards: bool, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`tensor` as a weight export yields it: with `tp_local_shards` a TP-sharded tensor as this rank's
    TP shard (`tp_local`), anything else whole (`full_tensor()` of a DTensor: a collective). With
    `dtype` the cast comes first, a DTensor's on its local shard, so the gathers move the cast bytes
    (half of fp32's for bf16) and the cast reads only this rank's shard; casting and gathering
    commute exactly."""
    if dtype is not None:
        tensor = tensor.to(dtype)
    if tp_local_shards and tp_shard_of(tensor) is not None:
        return tp_local(tensor)
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()
