"""In-process weight sync (colocated placement): the training engine's buckets straight into the
rollout engine's parameters, in place, so nothing is re-allocated and CUDA graphs stay valid.

The training engine yields buckets of full tensors under Hugging Face names (gathering FSDP shards).
Every bucket is kept until the whole sync has arrived and passed the structural check (each rollout
tensor exactly once, at its full shape: `checksum.check_names`); only then are they copied into
the rollout engine, so a sync that fails on the way (the training engine raised, a tensor is
missing or misshapen) leaves the rollout on its previous weights and version. The cost: what the
training engine yields is held together for the duration of the sync: one copy of the weights in
the rollout dtype when they are gathered from FSDP shards (on top of the rollout's own copy),
nothing for tensors no gather moves (`lazy_cast`: views of the training weights, in their dtype,
cast by the copy into the rollout).

With `checksum` (sync.checksum), every tensor sent is compared bit for bit after the copy with what
the rollout model holds (read back under the same names, on the device: no hashing is needed when
both are in one process, and it costs one read of each): it proves the copy lossless; a mismatch
there means the rollout's loader is wrong, and the error says the weights are no longer trustworthy.
"""

from __future__ import annotations

import time

import torch

from rlloom.engines.rollout.base import RolloutEngine
from rlloom.models.adapter import hf_slots
from rlloom.models.fp8 import Fp8Rows, roundtrip
from rlloom.weight_sync.base import SyncReport, WeightSource, WeightSyncError
from rlloom.weight_sync.checksum import check_names, rank_layout, same_bits
from rlloom.weight_sync.reshard import RankLayout, full_box


def sync_inplace(
    source: WeightSource,
    sink: RolloutEngine,
    *,
    bucket_bytes: int = 256 << 20,
    dtype: torch.dtype | None = None,
    checksum: bool = False,
) -> SyncReport:
    """Push the source's current weights (cast to `dtype`) into the sink under the source's version.
    Raises WeightSyncError (the sink keeps its previous weights and version) when the sync is not
    whole: a tensor missing, sent twice, of the wrong shape, or the source raised."""
    start = time.perf_counter()
    version = source.version
    staged: list[tuple[str, torch.Tensor]] = []
    try:
        for bucket in source.named_weights(bucket_bytes=bucket_bytes, dtype=dtype, lazy_cast=True):
            staged.extend(bucket)
    except Exception as exc:
        raise _failed(version, sink, f"the training engine raised {type(exc).__name__}: {exc}") from exc
    layout = rank_layout(sink)
    problems = check_names(layout.shapes, [(n, tuple(t.shape)) for n, t in staged])
    if problems:
        raise _failed(version, sink, "; ".join(problems))
    sink.update_weights(staged, version)
    if checksum:
        _compare_after_copy(staged, sink, layout, version)
    return SyncReport(
        version=version,
        num_tensors=len(staged),
        num_bytes=sum(t.numel() * (dtype or t.dtype).itemsize for _, t in staged),
        seconds=time.perf_counter() - start,
    )


def _compare_after_copy(
    staged: list[tuple[str, torch.Tensor]], sink: RolloutEngine, layout: RankLayout, version: int
) -> None:
    """Every tensor the rollout holds whole, read back and compared bit for bit with what was sent
    (a tensor-parallel engine's slices are left out)."""
    whole = {n for n, box in layout.boxes.items() if box == full_box(layout.shapes[n])}
    held = {name: t for name, t in hf_slots(sink.model) if name in whole}
    bad = [
        name
        for name, t in staged
        if name in held and not same_bits(_expected(t, held[name]), held[name].detach())
    ]
    if bad:
        raise WeightSyncError(
            f"weight sync of version {version} copied wrong values into the rollout engine "
            f"({len(bad)} tensors differ from those sent: {', '.join(bad[:5])}); its weights are no longer "
            "trustworthy (a bug in its loader)"
        )


def _failed(version: int, sink: RolloutEngine, why: str) -> WeightSyncError:
    return WeightSyncError(
        f"weight sync of version {version} failed: {why}; the rollout engine keeps its previous weights "
        f"(version {sink.policy_version})"
    )


def _expected(sent: torch.Tensor, held: torch.Tensor | Fp8Rows) -> torch.Tensor:
    """What a lossless load of `sent` leaves in `held`: the same values in its dtype, or for an fp8
    matrix (rollout.quantization=fp8) the sent values quantized and read back."""
    if isinstance(held, Fp8Rows):
        return roundtrip(sent.to(held.q.device), held.dtype)
    return sent.to(held.dtype)
