"""The tensor-parallel phase of the broadcast tests (`broadcast_phases.worker` runs it after the
expert-parallel one, on all four processes): a tiny model trained on 2 ranks with parallel.tp=2
(the dense Qwen3 with tied embeddings, then the Qwen3-MoE: untied head, experts replicated over TP)
sends owner-only (`owner_layout`: each rank its TP shards) into one replica of rollout.tp=2, then
into two replicas of rollout.tp=1. Then all four hold the Qwen3-MoE with FSDP 2 x tp=2, and the dense
Qwen3 with pp=2 x tp=2, and check that each rank's owner-only export is the box of the full export
that `owner_layout` gives it."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

from rlloom.config import ParallelConfig, TrainEngineConfig
from rlloom.engines.train.native import NativeTrainEngine
from rlloom.models.checkpoint import build_model
from rlloom.parallel import ParallelDims
from rlloom.weight_sync.broadcast import SyncGroupSpec, join_sync_group, owner_layout, send_weights
from tests.weight_sync.ep_phase import receive, trained_engine
from tests.weight_sync.sync_helpers import hf_config, rollout_engine

KINDS = ("dense", "moe")
SYNCS = ("tp2", "tp1")
"""rollout.tp of each sync: files `tp_{kind}_{sync}_{rank}.pt` on the rollout ranks."""


def all_gathers(comm: CommDebugMode) -> int:
    """The all-gathers (DTensor's gathers: full_tensor, redistribute) counted by `comm`."""
    return sum(n for op, n in comm.get_comm_counts().items() if "all_gather" in str(op))


def _send(engine, spec: SyncGroupSpec, rank: int, layout, out: dict, key: str) -> None:
    group = join_sync_group(spec, rank, torch.device("cpu"))
    with CommDebugMode() as comm:
        report = send_weights(group, engine, bucket_bytes=8 << 10, checksum=True, layout=layout)
    out[key] = {
        "bytes": report.num_bytes,
        "pieces": sorted(report.checksums),
        "all_gathers": all_gathers(comm),
    }
    group.close()


def _train_side(kind: str, specs: tuple[SyncGroupSpec, ...], rank: int, folder: Path) -> dict:
    engine = trained_engine(kind, ParallelDims(world_size=2, tp=2))
    out: dict = {"tp_rank": engine.layout.tp_rank}
    with CommDebugMode() as comm:
        owned = {n: t.clone() for b in engine.named_weights(owned_only=True) for n, t in b}
    out["owned_all_gathers"] = all_gathers(comm)
    layouts = engine.weight_layouts()
    out["tp_shards"] = {n: w.tp_shard for n, w in layouts.items() if w.tp_shard is not None}
    layout = owner_layout(layouts, engine.layout.ep_rank, engine.layout.tp_rank)
    out["boxes"] = {n: [list(b) for r, b in o if r == rank] for n, o in layout.owners.items()}
    for spec, sync in zip(specs, SYNCS, strict=True):
        _send(engine, spec, rank, layout, out, sync)
    with CommDebugMode() as comm:
        full = {n: t.clone() for b in engine.named_weights() for n, t in b}
    out["full_all_gathers"] = all_gathers(comm)
    torch.save({"owned": owned, "full": full}, folder / f"tp_{kind}_export_{rank}.pt")
    return out


def tensor_parallel_sync(rank: int, ports: tuple[int, ...], folder: Path) -> None:
    """4 processes. Ranks 0, 1: `trained_engine` with parallel.tp=2 in a gloo world of their own,
    sending owner-only into ranks 2, 3 (a gloo world of their own): one replica of rollout.tp=2 (the
    tensor-parallel native engine), then two replicas of rollout.tp=1; for each of `KINDS`. Writes
    `tp_rank{rank}.json` (senders) and the export of each sender (owner-only and full)."""
    train = rank < 2
    world = folder / ("tp_train" if train else "tp_rollout")
    dist.init_process_group("gloo", init_method=f"file://{world}", rank=rank % 2, world_size=2)
    out: dict = {}
    for i, kind in enumerate(KINDS):
        specs = tuple(
            SyncGroupSpec(
                host="127.0.0.1", port=ports[2 * i + j], num_senders=2, num_receivers=2, rollout_tp=tp
            )
            for j, tp in enumerate((2, 1))
        )
        if train:
            out[kind] = _train_side(kind, specs, rank, folder)
        else:
            receive(
                rollout_engine(kind, tp_group=dist.group.WORLD),
                specs[0],
                rank,
                folder,
                f"tp_{kind}_tp2_{rank}",
            )
            receive(rollout_engine(kind), specs[1], rank, folder, f"tp_{kind}_tp1_{rank}")
    dist.barrier()
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{folder / 'tp_fsdp'}", rank=rank, world_size=4)
    out["fsdp_tp"] = _fsdp_tp_export(rank)
    out["pp_tp"] = _pp_tp_export(rank)
    dist.destroy_process_group()
    (folder / f"tp_rank{rank}.json").write_text(json.dumps(out))


def _fsdp_tp_export(rank: int) -> dict:
    """FSDP 2 x tp=2 on 4 ranks (a TP shard is FSDP-sharded on top: the owner-only export gathers it
    over FSDP only): the names whose owner-only tensor differs from its box of the full export."""
    return _export_check(trained_engine("moe", ParallelDims(world_size=4, tp=2)), rank)


def _pp_tp_export(rank: int) -> dict:
    """pp=2 x tp=2 on 4 ranks (the dense Qwen3, untrained): each stage's rank broadcasts its TP shards
    over the pp group, whose ranks share its tp rank."""
    torch.manual_seed(0)
    model = build_model(hf_config("dense"), dtype=torch.float32, device="cpu")
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.copy_(0.05 * torch.randn(tensor.shape))
    engine = NativeTrainEngine(
        TrainEngineConfig(lr=3e-2, max_tokens_per_micro_batch=80),
        model,
        parallel_dims=ParallelDims(world_size=4, pp=2, tp=2),
        pipeline=ParallelConfig(pp=2, tp=2),
    )
    return _export_check(engine, rank)


def _export_check(engine: NativeTrainEngine, rank: int) -> dict:
    """The names whose owner-only tensor differs from the box of the full export `owner_layout` gives
    this rank, and those whose box is not the whole tensor."""
    owned = {n: t.clone() for b in engine.named_weights(owned_only=True) for n, t in b}
    full = {n: t.clone() for b in engine.named_weights() for n, t in b}
    layout = owner_layout(engine.weight_layouts(), engine.layout.ep_rank, engine.layout.tp_rank)
    boxes = {n: next(b for r, b in o if r == rank) for n, o in layout.owners.items()}
    wrong = [
        n for n, box in boxes.items() if not torch.equal(owned[n], full[n][tuple(slice(*r) for r in box)])
    ]
    split = sorted(n for n, box in boxes.items() if tuple(box) != tuple((0, d) for d in full[n].shape))
    return {"tp_rank": engine.layout.tp_rank, "wrong": wrong, "split": split, "names": sorted(owned)}
