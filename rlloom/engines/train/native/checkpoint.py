"""Save and load the full training state as safetensors shards + JSON: nothing is ever unpickled.

Layout of an engine checkpoint folder (a sealed folder, see `rlloom.engines.train.sealed`):

    tensors_rank<r>.safetensors  rank r's local shards of every tensor (model, optimizer, offloaded
                                 optimizer state); a tensor held whole (or replicated) by rank 0 only
    chunks_rank<r>.json          for each tensor of that file, its offset in the global tensor
    state.json                   the state's tree: non-tensor values (optimizer param_groups) inline,
                                 tensors by name with global shape and dtype; engine counters
    rng_rank<r>.json             torch, CUDA, Python and NumPy random states of rank r
    manifest.json                size and sha256 of every other file, written last

Tensor names are `model/<fqn>`, `optim/state/<fqn>/<key>` and `extra/<name>`, with the FQNs of
`torch.distributed.checkpoint.state_dict` (the native model's names, not Hugging Face's).
Under pipeline parallelism each rank holds only its stages' tensors (under the whole model's
names): rank 0 writes the union of every rank's state tree, a chunk held by several ranks (a tied
embedding on the first and the last stage) is written by the lowest of them, and each rank loads
only the tensors it holds, so pp=2 and pp=1 load each other's checkpoints.
Any rank count loads any other's checkpoint: each rank reads, for every tensor, the overlap of its
own shard with the saved chunks. Every hash is checked (ranks split the work) before any tensor is
read. The folder is written to `<dir>.tmp` and swapped in whole, so a crash or a full disk
mid-save leaves the previous checkpoint untouched.
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from rlloom.engines.train.native.rng_state import rng_state, set_rng_state
from rlloom.engines.train.sealed import CheckpointError, swap_in, verify_folder, write_manifest
from rlloom.run_files import fresh_dir, write_text

STATE = "state.json"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _world() -> int:
    return dist.get_world_size() if _distributed() else 1


def _agree(error: str | None) -> None:
    """Raise the first rank's error on every rank (so no rank waits at a barrier for a failed one)."""
    errors = [error]
    if _distributed():
        errors = [None] * _world()
        dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    if first:
        raise CheckpointError(first)


def _state_dicts(model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
    if optimizers:
        model_sd, optim_sd = get_state_dict(model, optimizers)
        return {"model": model_sd, "optim": optim_sd}
    return {"model": get_model_state_dict(model)}


# ---- the state tree: tensors out by name, everything else as JSON ------------------------------


def _join(prefix: str, key: str) -> str:
    return f"{prefix}/{key}" if prefix else key


def _flatten(tree: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """JSON-able copy of `tree` with each tensor replaced by {"__tensor__": name} (collected in `tensors`)."""
    if isinstance(tree, torch.Tensor):
        tensors[prefix] = tree
        return {"__tensor__": prefix}
    if isinstance(tree, dict):
        if not all(isinstance(k, str) for k in tree):
            raise TypeError(
                f"state {prefix!r} has non-string keys; checkpoints store string-keyed dicts only"
            )
        return {k: _flatten(v, _join(prefix, k), tensors) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        items = [_flatten(v, _join(prefix, str(i)), tensors) for i, v in enumerate(tree)]
        return {"__tuple__": items} if isinstance(tree, tuple) else items
    if tree is None or isinstance(tree, bool | int | float | str):
        return tree
    raise TypeError(f"state {prefix!r} holds a {type(tree).__name__}, which checkpoints cannot store as JSON")


def _unflatten(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(tree, dict):
        if "__tensor__" in tree:
            return tensors[tree["__tensor__"]]
        if "__tuple__" in tree:
            return tuple(_unflatten(v, tensors) for v in tree["__tuple__"])
        return {k: _unflatten(v, tensors) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_unflatten(v, tensors) for v in tree]
    return tree


EXPERTS = ".moe.experts."
"""Names of routed-expert tensors (and their optimizer state) contain this: under expert
parallelism each EP rank holds a contiguous block of experts along dim 0, outside any DTensor."""


def _local_chunk(
    t: torch.Tensor, name: str = "", experts: tuple[int, int] = (0, 1)
) -> tuple[torch.Tensor, list[int], bool, list[int]]:
    """(this rank's part, its offset in the global tensor, whether this rank writes it, the global
    shape). `experts` = (this rank's EP rank, ep): an expert tensor's block is placed at its experts."""
    ep_rank, ep = experts
    if not isinstance(t, DTensor):  # held whole: written by the lowest rank holding it (`_writers`)
        part, offset, primary, shape = t, [0] * t.dim(), True, list(t.shape)
    else:
        _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        coord = t.device_mesh.get_coordinate() or []
        # Of the ranks holding the same chunk (replicated mesh dimensions) only the first writes it.
        # (FSDP over a TP-sharded dimension is a _StridedShard, which is no Shard: test replication.)
        primary = all(c == 0 for c, p in zip(coord, t.placements) if p.is_replicate())
        part, offset, shape = t.to_local(), list(offset), list(t.shape)
    if ep > 1 and EXPERTS in name and t.dim() > 0:
        offset[0] += ep_rank * shape[0]
        shape[0] *= ep
    return part, offset, primary, shape


# ---- save ---------------------------------------------------------------------------------------


def _write_rank_files(
    tmp: Path, tree: dict[str, Any], engine_state: dict[str, Any], experts: tuple[int, int]
) -> None:
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _flatten(tree, "", tensors)
    rank = _rank()
    local: dict[str, torch.Tensor] = {}
    offsets: dict[str, list[int]] = {}
    storages: set[int] = set()
    shapes: dict[str, Any] = {}
    chunks = {name: _local_chunk(t.detach(), name, experts) for name, t in tensors.items()}
    mine = {name: offset for name, (part, offset, writes, _) in chunks.items() if writes and part.numel() > 0}
    for name, (part, _, _, shape) in chunks.items():
        shapes[name] = {"shape": shape, "dtype": str(part.dtype).removeprefix("torch.")}
    everyone = _all_ranks((mine, skeleton, shapes))
    for name, (part, offset, _, _) in chunks.items():
        if name in mine and _writers(everyone, name, offset) == rank:
            part = part.to("cpu").contiguous()
            if (
                part.untyped_storage().data_ptr() in storages
            ):  # safetensors refuses shared storage (tied weights)
                part = part.clone()
            storages.add(part.untyped_storage().data_ptr())
            local[name] = part
            offsets[name] = offset
    save_file(local, str(tmp / f"tensors_rank{rank}.safetensors"))
    write_text(tmp / f"chunks_rank{rank}.json", json.dumps(offsets))
    write_text(tmp / f"rng_rank{rank}.json", json.dumps(rng_state()))
    if rank == 0:
        state = {
            "format": 1,
            "world_size": _world(),
            "engine": engine_state,
            "tree": _merged_tree([tree for _, tree, _ in everyone]),
            "tensors": {k: v for _, _, held in everyone for k, v in held.items()},
        }
        write_text(tmp / STATE, json.dumps(state, indent=1))


def _all_ranks(value: Any) -> list[Any]:
    """`value` of every rank, in rank order (an object all-gather)."""
    if not _distributed():
        return [value]
    out: list[Any] = [None] * _world()
    dist.all_gather_object(out, value)
    return out


def _writers(everyone: list[tuple[dict[str, list[int]], Any, Any]], name: str, offset: list[int]) -> int:
    """The lowest rank that would write the chunk of `name` at `offset` (one copy of each chunk)."""
    return next(r for r, (chunks, _, _) in enumerate(everyone) if chunks.get(name) == offset)


def _merged_tree(trees: list[Any]) -> Any:
    """The union of the ranks' state trees (under PP each holds its stages' entries): dicts merged
    by key, lists of names (an optimizer group's params) joined, other values the first rank's."""
    merged = trees[0]
    for tree in trees[1:]:
        merged = _merge(merged, tree)
    return merged


def _merge(a: Any, b: Any) -> Any:
    if isinstance(a, dict) and isinstance(b, dict):
        return {**b, **{k: _merge(v, b[k]) if k in b else v for k, v in a.items()}}
    if isinstance(a, list) and isinstance(b, list):
        if all(isinstance(x, str) for x in a + b):
            return a + [x for x in b if x not in a]
        if len(a) == len(b):
            return [_merge(x, y) for x, y in zip(a, b)]
    return a


def save_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    extra_tensors: dict[str, torch.Tensor],
    engine_state: dict[str, Any],
    experts: tuple[int, int] = (0, 1),
) -> None:
    """Write a checkpoint to `path` (every rank calls this; `path` is on a shared filesystem).

    `experts` = (this rank's EP rank, ep) under expert parallelism: expert tensors are stored whole
    (all experts), so any other layout loads them.

    On any error (e.g. a full disk) every rank raises CheckpointError, the temporary folder is
    removed and an existing checkpoint at `path` is left as it was.
    """
    final = Path(path)
    tmp = final.with_name(final.name + ".tmp")
    error = None
    try:
        if _rank() == 0:
            fresh_dir(tmp)
    except OSError as e:
        error = f"saving checkpoint {str(final)!r} failed: {e}"
    _agree(error)
    tree = _state_dicts(model, optimizers)
    if extra_tensors:
        tree["extra"] = extra_tensors
    try:
        _write_rank_files(tmp, tree, engine_state, experts)
    except Exception as e:  # safetensors reports I/O errors (a full disk) as its own type
        error = f"saving checkpoint {str(final)!r} failed on rank {_rank()}: {e}"
    try:
        _agree(error)
        if _rank() == 0:
            try:
                write_manifest(tmp)
                swap_in(tmp, final)
            except OSError as e:
                error = f"saving checkpoint {str(final)!r} failed: {e}"
        _agree(error)
    except CheckpointError as e:
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(
            f"{e}. The temporary folder was removed and the previous checkpoint is unchanged. "
            "Fix: free disk space (or lower trainer.keep_last_checkpoints) and check the folder is writable."
        ) from e


# ---- load ---------------------------------------------------------------------------------------


def check_complete(path: str | os.PathLike) -> dict[str, Any]:
    """Raise CheckpointError (naming the file) unless `path` is intact; every rank hashes its share."""
    error = None
    try:
        verify_folder(path, share=(_rank(), _world()))
    except CheckpointError as e:
        error = str(e)
    _agree(error)
    return json.loads((Path(path) / STATE).read_text())


def _fill(
    target: torch.Tensor,
    name: str,
    meta: dict[str, Any],
    chunks: list[tuple[Any, list[int]]],
    experts: tuple[int, int],
) -> None:
    """Copy into `target` (this rank's part of tensor `name`) its overlap with every saved chunk."""
    part, offset, _, shape = _local_chunk(target, name, experts)
    if shape != meta["shape"] or str(target.dtype).removeprefix("torch.") != meta["dtype"]:
        raise CheckpointError(
            f"checkpoint tensor {name!r} is {meta['dtype']} {meta['shape']}, the engine's is "
            f"{target.dtype} {shape}. Fix: load it into an engine built with the same model."
        )
    if part.dim() == 0 and chunks:
        part.copy_(chunks[0][0].get_tensor(name))
        return
    covered = 0
    for handle, saved_offset in chunks:
        piece = handle.get_slice(name)
        saved_shape = piece.get_shape()
        lo = [max(a, b) for a, b in zip(offset, saved_offset)]
        hi = [min(a + n, b + m) for a, n, b, m in zip(offset, part.shape, saved_offset, saved_shape)]
        if any(h <= low for low, h in zip(lo, hi)):
            continue
        src = piece[tuple(slice(a - b, c - b) for a, b, c in zip(lo, saved_offset, hi))]
        part[tuple(slice(a - b, c - b) for a, b, c in zip(lo, offset, hi))].copy_(src)
        covered += int(torch.Size([c - a for a, c in zip(lo, hi)]).numel())
    if covered != part.numel():
        raise CheckpointError(
            f"checkpoint tensor {name!r} is incomplete: its saved chunks cover {covered} of {part.numel()} elements"
        )


def load_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    extra_tensors: dict[str, torch.Tensor],
    experts: tuple[int, int] = (0, 1),
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Load `path` into `model` and `optimizers` in place and restore this rank's RNG states.

    `extra_tensors` are templates (right shapes and layouts) for the extra state saved alongside;
    `experts` as in `save_checkpoint` (the saving layout's may differ). Returns (engine state,
    loaded extra tensors).
    """
    root = Path(path)
    state = check_complete(root)
    tree = _state_dicts(model, optimizers)
    if extra_tensors:
        tree["extra"] = extra_tensors
    targets: dict[str, torch.Tensor] = {}
    _flatten(tree, "", targets)
    saved = state["tensors"]
    # Under pipeline parallelism each rank holds some tensors; together they hold all.
    held = set().union(*_all_ranks(sorted(targets)))
    if not targets.keys() <= saved.keys() or held != saved.keys():
        missing, unexpected = sorted(held - saved.keys()), sorted(saved.keys() - held)
        raise CheckpointError(
            f"checkpoint {str(root)!r} does not fit this engine: tensors missing {missing[:3]}, unexpected "
            f"{unexpected[:3]}. Fix: load it with the model and train settings (optimizer_offload) it was saved with."
        )
    with ExitStack() as stack, torch.no_grad():
        per_name: dict[str, list[tuple[Any, list[int]]]] = {n: [] for n in saved}
        for r in range(state["world_size"]):
            handle = stack.enter_context(
                safe_open(str(root / f"tensors_rank{r}.safetensors"), framework="pt")
            )
            for name, offset in json.loads((root / f"chunks_rank{r}.json").read_text()).items():
                per_name[name].append((handle, offset))
        for name, target in targets.items():
            _fill(target, name, saved[name], per_name[name], experts)
    # This rank's own tree (its tensors now loaded) where it holds only part of the saved one.
    loaded = _unflatten(state["tree"], targets) if targets.keys() == saved.keys() else tree
    if optimizers:
        set_state_dict(model, optimizers, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    else:
        set_model_state_dict(model, loaded["model"])
    # With another rank count than at save time, ranks reuse the saved ranks' streams cyclically.
    saved_rank = _rank() % state["world_size"]
    set_rng_state(json.loads((root / f"rng_rank{saved_rank}.json").read_text()))
    return state["engine"], loaded.get("extra", {})


def read_model_tensors(path: str | os.PathLike, *, heads: bool = False) -> dict[str, torch.Tensor]:
    """The full model tensors of an engine checkpoint folder (after verifying it), fp32 on CPU.

    Names are the native CausalLM's `state_dict` names (e.g. `layers.0.attention.wq.weight`), so
    `CausalLM.load_state_dict` takes the result; they are not Hugging Face names
    (`rlloom.models.adapter` maps them, `rlloom.models.save_pretrained` writes an HF folder).
    `heads`: every tensor of the engine's module instead, under its names there (the CausalLM's as
    `model.*`, a critic's value head as `score.*`).
    """
    root = Path(path)
    verify_folder(root)
    state = json.loads((root / STATE).read_text())
    # the engine's module (PolicyHead, ValueHead) holds the CausalLM as `model`
    prefix = "model/" if heads else "model/model."
    out = {
        name.removeprefix(prefix): torch.empty(meta["shape"], dtype=getattr(torch, meta["dtype"]))
        for name, meta in state["tensors"].items()
        if name.startswith(prefix)
    }
    with ExitStack() as stack, torch.no_grad():
        for r in range(state["world_size"]):
            handle = stack.enter_context(
                safe_open(str(root / f"tensors_rank{r}.safetensors"), framework="pt")
            )
            for name, offset in json.loads((root / f"chunks_rank{r}.json").read_text()).items():
                if name.startswith(prefix):
                    piece = handle.get_tensor(name)
                    region = tuple(slice(o, o + n) for o, n in zip(offset, piece.shape))
                    out[name.removeprefix(prefix)][region] = piece
    return out
