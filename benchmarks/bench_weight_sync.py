"""Weight-sync throughput (one table: transport, GB, ms, ms/GB).

GPU (default): random weights of a Qwen3 shape (`--model`, default 8b: 8.2B parameters, 16.4 GB in
bf16). The training side holds fp32 weights, as the training engine's master copy, and the sync
casts them to the rollout's bf16 (the training engine's `named_weights` is this same
`named_weight_buckets` over its model); the rollout side is a native rollout engine in bf16.
- `inplace`: training and rollout on one GPU, in one process (the colocated placement).
- `broadcast`: when 2 GPUs are visible, training on GPU 0 and rollout on GPU 1 in two processes,
  joined by the sync group (NCCL). Both ranks start each timed sync together (a barrier); the time
  is the slower rank's, from the start until the rollout's weights are in place (device synchronised).
GB counts the bytes that reach the rollout (bf16); each row is the median of `--repeats` syncs after
one warm-up. Checksums are off on GPU unless `--checksum` (sync.checksum=auto).

    python benchmarks/bench_weight_sync.py                 # 1 GPU: inplace; 2 GPUs: inplace + broadcast
    python benchmarks/bench_weight_sync.py --model 0.6b --bucket-mb 512
    python benchmarks/bench_weight_sync.py --smoke         # tiny shape on CPU (gloo), to check the script
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
from bench_rollout import SHAPES  # noqa: E402  (the shapes live in one place)

from rlloom.engines.rollout.native import NativeEngine
from rlloom.engines.train.native.weights import named_weight_buckets
from rlloom.models.checkpoint import build_model
from rlloom.parallel.distributed import free_port
from rlloom.weight_sync.broadcast import SyncGroupSpec, join_sync_group, send_weights
from rlloom.weight_sync.inplace import sync_inplace
from rlloom.weight_sync.receive import receive_weights

TINY = SHAPES["0.6b"] | {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}


class ModelSource:
    """The training side: fp32 weights, yielded in buckets under Hugging Face names."""

    def __init__(self, cfg: dict, device: torch.device) -> None:
        self.model = build_model(cfg, dtype=torch.float32, device=device)
        with torch.no_grad():
            for p in self.model.parameters():
                p.normal_(0, 0.02)
        self.version = 0

    def named_weights(
        self,
        *,
        bucket_bytes: int,
        dtype: torch.dtype | None = None,
        owned_only: bool = False,
        lazy_cast: bool = False,
    ):
        self.version += 1
        return named_weight_buckets(self.model, bucket_bytes=bucket_bytes, dtype=dtype, lazy_cast=lazy_cast)


def rollout_engine(cfg: dict, device: torch.device, dtype: torch.dtype) -> NativeEngine:
    model = build_model(cfg, dtype=dtype, device=device, fused_projections=True)
    return NativeEngine(model, max_model_len=256, num_blocks=4, block_size=16, max_num_seqs=4, compile=False)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_inplace(
    cfg: dict, device: torch.device, dtype: torch.dtype, args: argparse.Namespace
) -> tuple[float, float]:
    """(GB per sync, median seconds) of the in-place sync on one device."""
    source, engine = ModelSource(cfg, device), rollout_engine(cfg, device, dtype)
    times, gb = [], 0.0
    for _ in range(args.repeats + 1):
        synchronize(device)
        start = time.perf_counter()
        report = sync_inplace(
            source, engine, bucket_bytes=args.bucket_mb << 20, dtype=dtype, checksum=args.checksum
        )
        synchronize(device)
        times.append(time.perf_counter() - start)
        gb = report.num_bytes / 1e9
    return gb, statistics.median(times[1:])


def _broadcast_rank(rank: int, cfg: dict, port: int, args: argparse.Namespace, out: str) -> None:
    device = torch.device(f"cuda:{rank}") if args.device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    spec = SyncGroupSpec(host="127.0.0.1", port=port, num_senders=1, num_receivers=1, timeout_s=600)
    group = join_sync_group(spec, rank, device)
    side = ModelSource(cfg, device) if rank == 0 else rollout_engine(cfg, device, dtype)
    times, num_bytes = [], 0
    for _ in range(args.repeats + 1):
        group.barrier()
        synchronize(device)
        start = time.perf_counter()
        if rank == 0:
            send_weights(group, side, bucket_bytes=args.bucket_mb << 20, checksum=args.checksum)
        else:
            num_bytes = receive_weights(group, side, checksum=args.checksum).num_bytes
        synchronize(device)
        times.append(time.perf_counter() - start)
    group.close()
    Path(out, f"rank{rank}.txt").write_text(f"{num_bytes} {' '.join(map(str, times[1:]))}")


def bench_broadcast(cfg: dict, args: argparse.Namespace) -> tuple[float, float]:
    """(GB per sync, median seconds of the slower rank) of the broadcast sync between 2 processes."""
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_broadcast_rank, args=(cfg, free_port(), args, out), nprocs=2, join=True)
        sender, receiver = (Path(out, f"rank{r}.txt").read_text().split() for r in (0, 1))
    slower = [max(float(a), float(b)) for a, b in zip(sender[1:], receiver[1:])]
    return int(receiver[0]) / 1e9, statistics.median(slower)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="8b", help="the Qwen3 shape")
    parser.add_argument(
        "--smoke", action="store_true", help="a tiny shape on CPU (gloo), to check the script"
    )
    parser.add_argument("--bucket-mb", type=int, default=256, help="sync.bucket_mb")
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed syncs per transport (after one warm-up)"
    )
    parser.add_argument("--checksum", action="store_true", help="content checksums (slow on GPU)")
    args = parser.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --smoke on CPU")
    args.device = "cpu" if args.smoke else "cuda"
    cfg = TINY if args.smoke else SHAPES[args.model]
    rows = []
    device = torch.device("cpu") if args.smoke else torch.device("cuda:0")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    rows.append(("inplace", *bench_inplace(cfg, device, dtype, args)))
    if args.smoke or torch.cuda.device_count() >= 2:
        rows.append(("broadcast", *bench_broadcast(cfg, args)))
    title = torch.cuda.get_device_name() if not args.smoke else "CPU smoke run"
    print(
        f"weight sync, {'tiny' if args.smoke else 'Qwen3-' + args.model} shape, {title}, bucket {args.bucket_mb} MiB"
    )
    print(f"{'transport':<10} {'GB':>8} {'ms':>9} {'ms/GB':>8}")
    for name, gb, seconds in rows:
        print(f"{name:<10} {gb:>8.3f} {seconds * 1e3:>9.2f} {seconds * 1e3 / gb:>8.2f}")


if __name__ == "__main__":
    main()
