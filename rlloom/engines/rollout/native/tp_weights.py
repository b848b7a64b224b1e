"""Weights of a tensor-parallel rollout rank: what it holds by Hugging Face name
(`shard_dims_by_hf_name`, the engine's shard spec), copying full or already-sliced tensors into its
shard (`load_sharded`, the engine's update_weights), and loading its shard of a checkpoint without
ever holding the whole model (`from_pretrained_sharded`, what build_rollout_engine uses at tp > 1)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from rlloom.engines.rollout.native.tensor_parallel import Shard, TPShards, shard_model
from rlloom.models.adapter import NativeKey, StateDictAdapter, missing_hf_names, native_keys
from rlloom.models.checkpoint import build_model, read_checkpoint, resolve_path


def shard_dims_by_hf_name(model: nn.Module, shards: TPShards) -> dict[str, Shard | None]:
    """Hugging Face name -> this rank's Shard of the full tensor (None: replicated), every weight."""
    adapter = StateDictAdapter(model.args)
    return {adapter.hf_name(name, expert): shards.slices.get(name) for name, expert in native_keys(model)}


@torch.no_grad()
def load_sharded(
    model: nn.Module, shards: TPShards, named_tensors: Iterable[tuple[str, torch.Tensor]]
) -> set[NativeKey]:
    """Copy HF-named tensors into a sharded model in place: a full tensor gives this rank's slice, a
    tensor of the slice's shape is taken as it is. Unknown names and other shapes raise ValueError.
    Returns the native keys filled."""
    adapter = StateDictAdapter(model.args)
    slots: dict[NativeKey, torch.Tensor] = native_keys(model)
    filled: set[NativeKey] = set()
    for hf_name, tensor in named_tensors:
        if adapter.is_mtp_layer(hf_name):
            continue
        key = adapter.from_hf(hf_name)
        if key is None or key not in slots:
            if hf_name == "lm_head.weight" and model.args.tie_word_embeddings:
                continue
            raise ValueError(
                f"unexpected tensor {hf_name!r} with shape {list(tensor.shape)}: it has no place in this "
                f"{model.args.model_type} model. Fix: check that the weights match the rollout model."
            )
        target, shard = slots[key], shards.slices.get(key[0])
        if shard is not None:
            target = target.narrow(shard.dim, 0, shard.length)
            if tensor.shape != target.shape:
                full = tensor.shape[shard.dim] >= shard.start + shard.length
                tensor = tensor.narrow(shard.dim, shard.start, shard.length) if full else tensor
        if tensor.shape != target.shape:
            raise ValueError(
                f"tensor {hf_name!r} has shape {list(tensor.shape)} but rollout.tp rank {shards.rank} expects the "
                f"full tensor or its slice {list(target.shape)} ({shard}). Fix: send the full tensor or this slice."
            )
        target.copy_(tensor)
        filled.add(key)
    return filled


def from_pretrained_sharded(
    path_or_name: str, group: dist.ProcessGroup, *, dtype: torch.dtype, device: torch.device
) -> nn.Module:
    """This rank's shard of a checkpoint's (fused) rollout model: built on the meta device, cut, and
    only then given memory on `device`, so no rank holds the whole model and a model larger than one
    GPU loads; each full tensor passes through host memory once, one at a time. The model carries
    its `TPShards` as `tp_shards` (NativeEngine takes such a model as it is)."""
    path = resolve_path(path_or_name)
    cfg, tensors = read_checkpoint(path)
    model = build_model(cfg, dtype=dtype, device="meta", fused_projections=True)
    shards = shard_model(model, group)
    model.to_empty(device=device)
    model.init_buffers()
    with torch.no_grad():  # padding rows: never looked up and masked in the sampler, but kept finite
        for weight in {model.tok_embeddings.weight, model.lm_head_weight}:
            weight[shards.vocab_valid :].zero_()
    missing = missing_hf_names(model, load_sharded(model, shards, tensors))
    if missing:
        raise ValueError(
            f"checkpoint {str(path)!r} is missing {len(missing)} tensor(s): {', '.join(missing[:8])}. "
            "Fix: check that config.json matches the weights."
        )
    model.source_path = str(path)
    return model.eval()
