"""Per-sync verification: every rollout tensor received exactly once, whole (its slices tile it),
with the right shape and under one version; optionally the content checksum of every tensor (or
slice) compared between what the sender sent and what the receiver got.

The expected set comes from the rollout engine (`rank_layout`): the Hugging Face names and full
shapes of its model and, on a tensor-parallel engine, the slice of each this rank holds
(`weight_shard_slices()`). Every check returns the list of problems found (empty = the
sync is sound), so a transport can gather them and raise one `WeightSyncError` before any rollout
weight changes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import weakref
from collections.abc import Iterable

import torch

from rlloom.engines.rollout.base import RolloutEngine
from rlloom.models import CausalLM, hf_named_tensors
from rlloom.weight_sync.reshard import Box, RankLayout, box_numel, full_box, intersect

_LAYOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def rank_layout(engine: RolloutEngine) -> RankLayout:
    """What this rollout rank holds, from its engine: names and FULL shapes from the engine's model
    config (a meta-device copy, no memory) and, for a tensor-parallel engine, its slice of each
    tensor from `engine.weight_shard_slices()` (name -> (dim, start, length), None = whole).
    Computed once per engine (building the meta model takes a moment on large models)."""
    if engine not in _LAYOUTS:
        _LAYOUTS[engine] = _rank_layout(engine)
    return _LAYOUTS[engine]


def _rank_layout(engine: RolloutEngine) -> RankLayout:
    with torch.device("meta"):
        meta = CausalLM(
            dataclasses.replace(engine.full_args, fused_projections=False), engine.model.hf_config
        )
    shapes = {name: tuple(t.shape) for name, t in hf_named_tensors(meta)}
    slices = engine.weight_shard_slices()
    boxes = {}
    for name, shape in shapes.items():
        box = list(full_box(shape))
        if slices.get(name) is not None:
            dim, start, length = slices[name]
            box[dim] = (start, start + length)
        boxes[name] = tuple(box)
    return RankLayout(shapes=shapes, boxes=boxes)


def weight_dtype(engine: RolloutEngine) -> torch.dtype:
    """The dtype of the rollout engine's weights (what a sync casts to)."""
    return next(engine.model.parameters()).dtype


def piece_key(name: str, box: Box) -> str:
    """Key of a tensor slice in checksum tables: `name[0:4,0:2]`."""
    return f"{name}[{','.join(f'{a}:{b}' for a, b in box)}]"


def digest(tensor: torch.Tensor) -> str:
    """Content checksum: hex BLAKE2b of a tensor's dtype, shape and bytes, equal exactly when the
    values are. Both sides of a weight sync call it on what they sent and received (same dtype) to
    prove the transfer lossless. Costs one copy to the host."""
    t = tensor.detach().contiguous().cpu()
    h = hashlib.blake2b(f"{t.dtype}{tuple(t.shape)}".encode(), digest_size=16)
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold the same dtype, shape and bytes (NaNs compare equal to themselves),
    compared where they are, without a host copy."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(_bits(a), _bits(b.to(a.device)))


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers of its element size (comparing wide integers is several times
    faster than comparing bytes)."""
    return t.detach().view(_INT_OF_SIZE[t.element_size()])


def _names(names: Iterable[str], limit: int = 5) -> str:
    names = sorted(names)
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_names(
    expected: dict[str, tuple[int, ...]], received: list[tuple[str, tuple[int, ...]]]
) -> list[str]:
    """Problems with whole tensors received as (name, shape): each expected name exactly once, at its
    shape, and nothing else."""
    problems, seen = [], set()
    for name, shape in received:
        if name in seen:
            problems.append(f"tensor {name!r} was received twice")
        elif name not in expected:
            problems.append(f"tensor {name!r} has no place in the rollout model")
        elif tuple(shape) != tuple(expected[name]):
            problems.append(
                f"tensor {name!r} has shape {list(shape)}, the rollout expects {list(expected[name])}"
            )
        seen.add(name)
    missing = set(expected) - seen
    if missing:
        problems.append(f"{len(missing)} rollout tensors were not received: {_names(missing)}")
    return problems


def check_tiling(targets: dict[str, Box], pieces: list[tuple[str, Box]]) -> list[str]:
    """Problems with slices received as (name, box): the pieces of each target box cover it exactly
    once (inside it, no overlap, no gap), and no piece belongs to another tensor."""
    problems = []
    by_name: dict[str, list[Box]] = {}
    for name, box in pieces:
        by_name.setdefault(name, []).append(box)
    for name in set(by_name) - set(targets):
        problems.append(f"a slice of {name!r} arrived but this rollout rank holds no part of it")
    missing = [n for n in targets if n not in by_name and box_numel(targets[n]) > 0]
    if missing:
        problems.append(f"{len(missing)} rollout tensors were not received: {_names(missing)}")
    for name, boxes in by_name.items():
        target = targets.get(name)
        if target is None:
            continue
        inside = all(intersect(b, target) == b for b in boxes)
        overlap = any(intersect(a, b) is not None for i, a in enumerate(boxes) for b in boxes[i + 1 :])
        if not inside or overlap or sum(box_numel(b) for b in boxes) != box_numel(target):
            problems.append(
                f"the slices of {name!r} received {boxes} do not cover its box {target} exactly once"
            )
    return problems


def check_checksums(sent: dict[str, str], received: dict[str, str]) -> list[str]:
    """Problems when the receiver's content checksums differ from the sender's."""
    bad = [key for key, value in received.items() if sent.get(key) != value]
    missing = set(sent) - set(received)
    problems = [f"content checksum mismatch on {len(bad)} tensors: {_names(bad)}"] if bad else []
    if missing:
        problems.append(
            f"checksums of {len(missing)} sent tensors have no received counterpart: {_names(missing)}"
        )
    return problems
