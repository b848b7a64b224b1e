"""The expert-parallel phase of the broadcast tests (`broadcast_phases.worker` runs it first, on all
four processes): a Qwen3-MoE trained on 2 ranks with parallel.ep=2 sends owner-only into one replica
of rollout.tp=2, then into two replicas of rollout.tp=1, then without a training layout (full
tensors, the experts all-gathered over EP) into the two tp=1 replicas again."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from rlloom.algorithms.losses import aggregate_loss_sum
from rlloom.config import TrainEngineConfig
from rlloom.data.types import RolloutBatch, Sample
from rlloom.engines.train.native import NativeTrainEngine
from rlloom.models.checkpoint import build_model
from rlloom.parallel import ParallelDims
from rlloom.weight_sync.broadcast import SyncGroupSpec, join_sync_group, owner_layout, send_weights
from rlloom.weight_sync.checksum import rank_layout
from rlloom.weight_sync.receive import receive_weights
from tests.weight_sync.sync_helpers import VOCAB, expert_of, hf_config, rollout_engine

RECEIVED = ("tp2_2", "tp2_3", "tp1_2", "tp1_3")
"""The owner-only syncs' files on the rollout ranks: `ep_{sync}_{rank}.pt`."""
GATHERED = ("gathered_2", "gathered_3")
"""The sync without a training layout, on the two tp=1 replicas."""


def trained_engine(kind: str, dims: ParallelDims) -> NativeTrainEngine:
    """A tiny model (`sync_helpers.hf_config(kind)`; "moe": Qwen3-MoE with 4 experts per layer) in the
    parallel layout `dims`, after one AdamW step at lr 3e-2 (every tensor moves): the same random
    model and batch on every rank."""
    torch.manual_seed(0)
    model = build_model(hf_config(kind), dtype=torch.float32, device="cpu")
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.copy_(0.05 * torch.randn(tensor.shape))
    engine = NativeTrainEngine(TrainEngineConfig(lr=3e-2), model, parallel_dims=dims)
    gen = torch.Generator().manual_seed(1)
    samples = [
        Sample(prompt_ids=torch.randint(VOCAB, (5,), generator=gen).tolist(), response_ids=[3, 9, 4, 1])
        for _ in range(4)
    ]
    batch = RolloutBatch(samples)
    mask = batch.response_mask()

    def loss(logp_bT, entropy_bT, rows):
        return aggregate_loss_sum(-logp_bT, mask[rows], "seq-mean-token-sum"), {}

    engine.train_step(batch, loss, loss_normalizer=float(len(samples)))
    return engine


@contextmanager
def counting_all_gathers() -> Iterator[list[int]]:
    """Count the `dist.all_gather` calls made inside the block (the export's EP all-gather uses it):
    `with counting_all_gathers() as calls: ...; calls[0]`. Restores `dist.all_gather` on the way out."""
    calls, original = [0], dist.all_gather

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    dist.all_gather = counted
    try:
        yield calls
    finally:
        dist.all_gather = original


def _send(engine: NativeTrainEngine, spec: SyncGroupSpec, rank: int, layout, out: dict, key: str) -> None:
    group = join_sync_group(spec, rank, torch.device("cpu"))
    with counting_all_gathers() as gathers:
        report = send_weights(group, engine, bucket_bytes=8 << 10, checksum=True, layout=layout)
    out[key] = {"bytes": report.num_bytes, "pieces": sorted(report.checksums), "all_gathers": gathers[0]}
    group.close()


def receive(engine, spec: SyncGroupSpec, rank: int, folder: Path, key: str) -> None:
    """Receive into `engine`; save what reached it (name -> tensor, as loaded) and the rank's boxes."""
    group = join_sync_group(spec, rank, torch.device("cpu"))
    loaded: dict[str, torch.Tensor] = {}
    load = engine.update_weights

    def recording(named, version):
        named = list(named)
        loaded.update((n, t.clone()) for n, t in named)
        load(named, version)

    engine.update_weights = recording
    receive_weights(group, engine, checksum=True)
    boxes = rank_layout(engine).boxes
    torch.save({"loaded": loaded, "boxes": boxes, "version": engine.policy_version}, folder / f"{key}.pt")
    group.close()


def expert_parallel_sync(rank: int, ports: tuple[int, int, int], folder: Path) -> None:
    """4 processes. Ranks 0, 1: `trained_engine` (parallel.ep=2) in a gloo world of their own; both send owner-only
    (`owner_layout`) into ranks 2, 3: first one replica of rollout.tp=2 (the tensor-parallel native
    engine, in a gloo world of ranks 2 and 3), then two replicas of rollout.tp=1; then both send
    without a layout (full tensors) into two replicas of rollout.tp=1. Writes `ep_rank{rank}.json`
    and the weights each side saw (`ep_full.pt`: the all-gathered export on rank 0, after the syncs)."""
    train = rank < 2
    world = folder / ("ep_train" if train else "ep_rollout")
    dist.init_process_group("gloo", init_method=f"file://{world}", rank=rank % 2, world_size=2)
    out: dict = {}
    tp2, tp1, full_tp1 = (
        SyncGroupSpec(host="127.0.0.1", port=port, num_senders=2, num_receivers=2, rollout_tp=tp)
        for port, tp in zip(ports, (2, 1, 1), strict=True)
    )
    if train:
        engine = trained_engine("moe", ParallelDims(world_size=2, ep=2))
        out["owned_experts"] = sorted(
            {expert_of(n) for b in engine.named_weights(owned_only=True) for n, _ in b} - {None}
        )
        layout = owner_layout(engine.weight_layouts(), engine.layout.ep_rank, engine.layout.tp_rank)
        out["owners"] = {n: sorted({r for r, _ in o}) for n, o in layout.owners.items()}
        out["shapes"] = {n: list(s) for n, s in layout.shapes.items()}
        _send(engine, tp2, rank, layout, out, "tp2")
        _send(engine, tp1, rank, layout, out, "tp1")
        _send(engine, full_tp1, rank, None, out, "gathered")
        with counting_all_gathers() as gathers:
            full = {n: t.clone() for b in engine.named_weights() for n, t in b}
        out["full_all_gathers"] = gathers[0]
        if rank == 0:
            torch.save(full, folder / "ep_full.pt")
    else:
        receive(rollout_engine("moe", tp_group=dist.group.WORLD), tp2, rank, folder, f"ep_tp2_{rank}")
        receive(rollout_engine("moe"), tp1, rank, folder, f"ep_tp1_{rank}")
        receive(rollout_engine("moe"), full_tp1, rank, folder, f"ep_gathered_{rank}")
    dist.barrier()
    dist.destroy_process_group()
    (folder / f"ep_rank{rank}.json").write_text(json.dumps(out))
