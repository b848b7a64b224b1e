"""In-process weight sync (colocated placement): the training engine's buckets straight into the
rollout engine's parameters, in place, so nothing is re-allocated and CUDA graphs stay valid.

The training engine yields buckets of full tensors under Hugging Face names (gathering FSDP shards).
Every bucket is kept until the whole sync has arrived and passed the structural check (each rollout
tensor exactly once, at its full shape: `checksum.check_names`); only then are they copied into
the rollout engine, so a sync that fails on the way (the training engine raised, a tensor is
missing or misshapen) leaves the rollout on its previous weights and version. The cost: what the
training engine yields is held together for the duration of the sync: one copy of the weights in
the rollout dtype when they are cast or gathered from FSDP shards (on top of the rollout's own
copy), nothing for unsharded tensors already in that dtype (views of the training weights).

With `checksum`, the content checksum of every tensor sent is compared after the copy with what the
rollout model holds (read back under the same names): it proves the copy lossless; a mismatch there
means the rollout's loader is wrong, and the error says the rollout weights are no longer trustworthy.
"""

from __future__ import annotations

import time

import torch

from rlloom.models import hf_named_tensors
from rlloom.weight_sync.base import SyncReport, WeightSink, WeightSource, WeightSyncError
from rlloom.weight_sync.checksum import check_checksums, check_names, digest, rank_layout
from rlloom.weight_sync.reshard import full_box


def sync_inplace(
    source: WeightSource,
    sink: WeightSink,
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
        for bucket in source.named_weights(bucket_bytes=bucket_bytes, dtype=dtype):
            staged.extend(bucket)
    except Exception as exc:
        raise _failed(version, sink, f"the training engine raised {type(exc).__name__}: {exc}") from exc
    layout = rank_layout(sink)
    problems = check_names(layout.shapes, [(n, tuple(t.shape)) for n, t in staged])
    if problems:
        raise _failed(version, sink, "; ".join(problems))
    # a tensor-parallel engine keeps a slice of some tensors: those are not read back
    whole = {n for n, box in layout.boxes.items() if box == full_box(layout.shapes[n])}
    sent = {name: digest(t) for name, t in staged if name in whole} if checksum else {}
    sink.update_weights(staged, version)
    if checksum:
        got = {name: digest(t) for name, t in hf_named_tensors(sink.model) if name in sent}  # type: ignore[attr-defined]
        problems = check_checksums(sent, got)
        if problems:
            raise WeightSyncError(
                f"weight sync of version {version} copied wrong values into the rollout engine: "
                f"{'; '.join(problems)}; its weights are no longer trustworthy (a bug in its loader)"
            )
    return SyncReport(
        version=version,
        num_tensors=len(staged),
        num_bytes=sum(t.numel() * t.element_size() for _, t in staged),
        seconds=time.perf_counter() - start,
        checksums=sent,
    )


def _failed(version: int, sink: WeightSink, why: str) -> WeightSyncError:
    return WeightSyncError(
        f"weight sync of version {version} failed: {why}; the rollout engine keeps its previous weights "
        f"(version {getattr(sink, 'policy_version', '?')})"
    )
