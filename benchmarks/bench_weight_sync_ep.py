"""Broadcast weight sync of an expert- or tensor-parallel MoE: owner-only sending against
gather-then-send (one table: mode, GB, ms, ms/GB).

max(`--ep`, `--tp`) training ranks hold a Qwen3-MoE shape (`--layers`, `--experts`, ...; default 3.1B
parameters, 2.4B of them in experts, 6.2 GB in bf16) in a NativeTrainEngine with parallel.ep = `--ep`
and parallel.tp = `--tp` (fp32 master weights, uninitialised: only the bytes moved matter), and
`--rollout-tp` ranks hold one native rollout engine in bf16. Both modes cast to bf16 on the way and
reach the same rollout weights:
- `owner-only`: what a run does (separate placement): every training rank sends, each only its own
  experts, its TP shards and a share of the other tensors (`named_weights(owned_only=True)`,
  `owner_layout`).
- `gather`: the previous protocol: every training rank all-gathers every expert over EP and every
  TP shard over TP (no layout: `named_weights(owned_only=False)`), rank 0 alone sends everything.
Each row is the median of `--repeats` syncs after one warm-up; a sync's time is the slowest rank's,
from a common start (a barrier) until the rollout's weights are in place (devices synchronised).

    python benchmarks/bench_weight_sync_ep.py                   # GPU: max(ep, tp) + rollout_tp GPUs (3 by default)
    python benchmarks/bench_weight_sync_ep.py --ep 4 --rollout-tp 2 --experts 128
    python benchmarks/bench_weight_sync_ep.py --ep 1 --tp 2 --rollout-tp 2   # TP shards only
    python benchmarks/bench_weight_sync_ep.py --colocated --ep 2 # 2 GPUs: each rank fills its own replica in place
    python benchmarks/bench_weight_sync_ep.py --smoke           # tiny shape on CPU (gloo), to check the script
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlloom.config import TrainEngineConfig
from rlloom.engines.rollout.native import NativeEngine
from rlloom.engines.train.native import NativeTrainEngine
from rlloom.models.checkpoint import build_model
from rlloom.parallel import ParallelDims
from rlloom.parallel.distributed import free_port
from rlloom.weight_sync.broadcast import (
    SyncGroupSpec,
    join_sync_group,
    owner_layout,
    send_weights,
)
from rlloom.weight_sync.inplace import sync_inplace
from rlloom.weight_sync.receive import receive_weights

MODES = ("owner-only", "gather")


def moe_config(args: argparse.Namespace) -> dict:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        moe_intermediate_size=args.moe_intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 128 if args.hidden >= 128 else 4,
        num_key_value_heads=4,
        head_dim=128 if args.hidden >= 128 else args.hidden // 4,
        num_experts=args.experts,
        num_experts_per_tok=8 if args.experts >= 8 else 2,
        max_position_embeddings=4096,
    ).to_dict()


def _rank_device(rank: int, args: argparse.Namespace) -> torch.device:
    """This process's device (GPU `rank`, or the CPU for --smoke), made current; one CPU thread."""
    torch.set_num_threads(1)
    if args.smoke:
        return torch.device("cpu")
    device = torch.device(f"cuda:{rank}")
    torch.cuda.set_device(device)
    return device


def _training_engine(cfg: dict, args: argparse.Namespace, device: torch.device) -> NativeTrainEngine:
    """A training rank of the layout ep x tp (fp32 master weights, uninitialised)."""
    dims = ParallelDims(world_size=max(args.ep, args.tp), ep=args.ep, tp=args.tp)
    model = build_model(cfg, dtype=torch.float32, device=device)
    return NativeTrainEngine(TrainEngineConfig(compile=False), model, device=device, parallel_dims=dims)


def _rollout_engine(cfg: dict, device: torch.device, **tp: object) -> NativeEngine:
    """A rollout engine in the rollout's dtype (bf16 on GPU), small KV cache."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(cfg, dtype=dtype, device=device, fused_projections=True)
    return NativeEngine(
        model, max_model_len=256, num_blocks=4, block_size=16, max_num_seqs=4, compile=False, **tp
    )


def _colocated_rank(rank: int, args: argparse.Namespace, out: str) -> None:
    """The colocated placement: each training rank fills the rollout replica on its own GPU in
    place (`sync_inplace`: the experts other ranks own are gathered over EP first)."""
    device = _rank_device(rank, args)
    gpu = device.type == "cuda"
    dist.init_process_group(
        "nccl" if gpu else "gloo",
        init_method=f"file://{out}/train",
        rank=rank,
        world_size=max(args.ep, args.tp),
    )
    cfg = moe_config(args)
    train, rollout = _training_engine(cfg, args, device), _rollout_engine(cfg, device)
    dtype = torch.bfloat16 if gpu else torch.float32
    times, num_bytes = [], 0
    for _ in range(args.repeats + 1):
        dist.barrier()
        if gpu:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        num_bytes = sync_inplace(train, rollout, bucket_bytes=args.bucket_mb << 20, dtype=dtype).num_bytes
        if gpu:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    Path(out, f"rank{rank}.txt").write_text(f"in-place {num_bytes} {' '.join(map(str, times[1:]))}")
    dist.barrier()
    dist.destroy_process_group()


def _rank(rank: int, args: argparse.Namespace, ports: tuple[int, ...], out: str) -> None:
    """Training ranks 0..n-1 (n = max(ep, tp), a world of their own), rollout ranks n.. (a world of
    their own when rollout_tp > 1); both sync groups (one per mode) are joined once."""
    device = _rank_device(rank, args)
    gpu = device.type == "cuda"
    senders = max(args.ep, args.tp)
    train = rank < senders
    size, local = (senders, rank) if train else (args.rollout_tp, rank - senders)
    world = Path(out, "train" if train else "rollout")
    if train or size > 1:
        dist.init_process_group(
            "nccl" if gpu else "gloo", init_method=f"file://{world}", rank=local, world_size=size
        )
    cfg = moe_config(args)
    if train:
        side = _training_engine(cfg, args, device)
        layout = owner_layout(side.weight_layouts(), side.layout.ep_rank, side.layout.tp_rank)
    else:
        side = _rollout_engine(cfg, device, **({"tp_group": dist.group.WORLD} if size > 1 else {}))
    specs = {
        "owner-only": SyncGroupSpec(
            host="127.0.0.1", port=ports[0], num_senders=senders, num_receivers=args.rollout_tp,
            rollout_tp=args.rollout_tp, timeout_s=900,
        ),
        "gather": SyncGroupSpec(
            host="127.0.0.1", port=ports[1], num_senders=1, num_receivers=args.rollout_tp,
            rollout_tp=args.rollout_tp, timeout_s=900,
        ),
    }  # fmt: skip
    lines = []
    for mode, spec in specs.items():
        # the gather mode's group has one sender: training ranks 1.. stay out of it (sync rank -1)
        sync_rank = rank if train else spec.num_senders + local
        group = join_sync_group(spec, sync_rank, device) if not (train and rank >= spec.num_senders) else None
        times, num_bytes = [], 0
        for _ in range(args.repeats + 1):
            if group is not None:
                group.barrier()
            if train:
                dist.barrier()
            if gpu:
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            if not train:
                receive_weights(group, side)
            elif mode == "owner-only":
                num_bytes = send_weights(
                    group, side, bucket_bytes=args.bucket_mb << 20, layout=layout
                ).num_bytes
            else:
                num_bytes = send_weights(group, side, bucket_bytes=args.bucket_mb << 20).num_bytes
            if gpu:
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        if group is not None:
            group.close()
        lines.append(f"{mode} {num_bytes} {' '.join(map(str, times[1:]))}")
    Path(out, f"rank{rank}.txt").write_text("\n".join(lines))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--smoke", action="store_true", help="a tiny shape on CPU (gloo), to check the script"
    )
    parser.add_argument("--ep", type=int, default=2, help="parallel.ep (training ranks: max(ep, tp))")
    parser.add_argument("--tp", type=int, default=1, help="parallel.tp (training ranks: max(ep, tp))")
    parser.add_argument("--rollout-tp", type=int, default=1, help="rollout ranks (one replica, rollout.tp)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--moe-intermediate", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--bucket-mb", type=int, default=256, help="sync.bucket_mb")
    parser.add_argument("--repeats", type=int, default=5, help="timed syncs per mode (after one warm-up)")
    parser.add_argument(
        "--colocated",
        action="store_true",
        help="each training rank fills a rollout replica on its own GPU in place (no rollout ranks)",
    )
    args = parser.parse_args()
    if args.smoke:
        args.layers, args.experts, args.hidden, args.moe_intermediate, args.vocab = 2, 4, 32, 16, 64
        args.bucket_mb, args.repeats = 1, 2
    senders = max(args.ep, args.tp)
    nprocs = senders if args.colocated else senders + args.rollout_tp
    if not args.smoke and torch.cuda.device_count() < nprocs:
        parser.error(
            f"needs {nprocs} GPUs (max(ep, tp), + rollout-tp unless --colocated); run with --smoke on CPU"
        )
    with tempfile.TemporaryDirectory() as out:
        if args.colocated:
            mp.spawn(_colocated_rank, args=(args, out), nprocs=nprocs, join=True)
        else:
            mp.spawn(_rank, args=(args, (free_port(), free_port()), out), nprocs=nprocs, join=True)
        ranks = [Path(out, f"rank{r}.txt").read_text().splitlines() for r in range(nprocs)]
    title = "CPU smoke run" if args.smoke else torch.cuda.get_device_name()
    target = "a replica per rank, in place" if args.colocated else f"rollout.tp={args.rollout_tp}"
    print(
        f"weight sync of a Qwen3-MoE shape ({args.layers} layers, {args.experts} experts, hidden {args.hidden}), "
        f"ep={args.ep} tp={args.tp} -> {target}, {title}, bucket {args.bucket_mb} MiB"
    )
    print(f"{'mode':<11} {'GB':>8} {'ms':>9} {'ms/GB':>8}")
    for i, mode in enumerate(["in-place"] if args.colocated else MODES):
        rows = [r[i].split() for r in ranks]
        # bytes the senders sent; colocated: what one rank's replica received (each gets the whole model)
        gb = (int(rows[0][1]) if args.colocated else sum(int(r[1]) for r in rows[:senders])) / 1e9
        slowest = [max(float(r[k]) for r in rows) for k in range(2, len(rows[0]))]
        ms = statistics.median(slowest) * 1e3
        print(f"{mode:<11} {gb:>8.3f} {ms:>9.2f} {ms / gb:>8.2f}")


if __name__ == "__main__":
    main()
