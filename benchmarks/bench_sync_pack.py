"""Where the broadcast sync's time outside the transport goes: the sender's cast and packing and the
receiver's unpacking, per GiB on the wire, against plain torch baselines in the same run (one table).

The training side holds fp32 weights of a Qwen3 shape (`--model`), the rollout side is a native
rollout engine in bf16 (fused q/k/v and gate/up, as in a run). One sender, one rollout rank; the
transport is replaced: the sender's buckets are kept in memory and the receiver copies each into
its own buffer (that copy stands in for the broadcast). Checksums off (sync.checksum=auto on GPU).
Each row is the median of `--repeats` rounds (every stage once, in turn) after a warm-up one; GiB
counts the bf16 bytes on the wire. CPU numbers only check the script and show proportions; the
question (what the 4.4 ms/GiB outside NCCL is) is answered on the GPU (`--device cuda`).

- `cat+cast (torch)`: torch.cat of the flattened fp32 tensors, a bucket's worth at a time, then
  .to(bf16): the plain way to pack.
- `copy-cast (torch)`: each fp32 tensor copy_'d into one preallocated bf16 buffer (the cast fused
  into the copy): the floor of cast + pack.
- `export`: the training engine's export, `named_weight_buckets(dtype=bf16)`: the cast, HF names.
- `send`: `send_weights`, transport replaced: export, plan (kept after the first sync), packing
  into buckets, manifest and trailer.
- `pack (send - export)`: what the sender adds to the export.
- `copy (torch)`: the same bytes copied once, bf16 -> bf16: the wire stand-in's cost.
- `receive`: `receive_weights`, transport replaced: the stand-in copies, staging, tiling checks,
  assembling and loading into the engine (`update_weights`).
- `unpack (receive - copy)`: what the receiver adds to the wire.
- `split+copy (torch)`: one flat bf16 buffer copied into the engine's parameters, one copy_ each:
  the floor of loading.

    python benchmarks/bench_sync_pack.py                    # CPU, Qwen3-0.6B shape (~8 GB of memory)
    python benchmarks/bench_sync_pack.py --device cuda --model 8b   # ~100 GB of GPU memory (H200)
    python benchmarks/bench_sync_pack.py --smoke            # tiny shape on CPU, to check the script
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_rollout import SHAPES  # noqa: E402
from bench_weight_sync import TINY, ModelSource, rollout_engine, synchronize  # noqa: E402

from rlloom.models import hf_named_tensors
from rlloom.weight_sync import broadcast, outbox, receive
from rlloom.weight_sync.broadcast import SyncGroup, SyncGroupSpec, send_weights
from rlloom.weight_sync.checksum import rank_layout
from rlloom.weight_sync.group import Link
from rlloom.weight_sync.receive import receive_weights
from rlloom.weight_sync.wire import encode_layout

DTYPE = torch.bfloat16


class Wire:
    """The transport, replaced: what the sender broadcasts is kept, and the receiver takes it."""

    def __init__(self, hello: bytes) -> None:
        self.hello = hello
        self.messages: list[bytes] = []
        """The manifest, then the trailer."""
        self.buckets: list[torch.Tensor] = []
        self.read = self.taken = 0

    def install(self) -> None:
        """Put this wire in place of the sync group's transport, on both sides."""
        broadcast.exchange, outbox.post_broadcast = self._send
        receive.exchange, receive.post_broadcast = self._receive
        for module in (broadcast, outbox, receive):
            module.wait_all = lambda works, deadline, what: None

    @property
    def _send(self):
        def exchange(links, payloads, *, root, **kwargs):
            if root == 1:
                return [self.hello]
            self.messages.extend(payloads)
            return payloads

        return exchange, lambda link, tensor, root: self.buckets.append(tensor)

    @property
    def _receive(self):
        def exchange(links, payloads, *, root, **kwargs):
            if root == 1:
                return payloads
            self.read += 1
            return [self.messages[self.read - 1]]

        def take(link, tensor, root):
            tensor.copy_(self.buckets[self.taken])
            self.taken += 1

        return exchange, take


def _group(rank: int, device: torch.device) -> SyncGroup:
    spec = SyncGroupSpec(host="127.0.0.1", port=0, num_senders=1, num_receivers=1)
    return SyncGroup(spec=spec, rank=rank, device=device, links={(0, 0): Link(pg=None, local_rank=rank)})


def _medians(stages: dict[str, Callable[[], object]], device: torch.device, repeats: int) -> dict[str, float]:
    """Median seconds of each stage over `repeats` rounds after a warm-up one; a round runs every
    stage once, in order, so a slow spell of a shared machine hits them all alike."""
    times: dict[str, list[float]] = {name: [] for name in stages}
    for _ in range(repeats + 1):
        for name, fn in stages.items():
            synchronize(device)
            start = time.perf_counter()
            fn()
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t[1:]) for name, t in times.items()}


def measure(cfg: dict, device: torch.device, bucket_bytes: int, repeats: int) -> list[tuple[str, float]]:
    """(row, seconds) for every row of the table, and the bytes on the wire as the row `bytes`."""
    source, engine = ModelSource(cfg, device), rollout_engine(cfg, device, DTYPE)
    params = [p.detach() for p in source.model.parameters()]
    targets = [p.detach() for p in engine.model.parameters()]
    sender, receiver = _group(0, device), _group(1, device)
    wire = Wire(encode_layout(rank_layout(engine), DTYPE))
    wire.install()

    def sync() -> None:
        wire.messages, wire.buckets = [], []
        send_weights(sender, source, bucket_bytes=bucket_bytes)

    def take() -> None:
        wire.read = wire.taken = 0
        receive_weights(receiver, engine)

    sync()
    take()
    sent = {n: t for b in source.named_weights(bucket_bytes=bucket_bytes, dtype=DTYPE) for n, t in b}
    loaded = dict(hf_named_tensors(engine.model))
    assert sent.keys() == loaded.keys() and all(torch.equal(sent[n], loaded[n]) for n in sent)
    del sent, loaded
    num_bytes = sum(b.numel() * b.element_size() for b in wire.buckets)
    flat = torch.empty(num_bytes // DTYPE.itemsize, dtype=DTYPE, device=device)

    groups: list[list[torch.Tensor]] = [[]]  # the fp32 tensors in runs of at most a bucket (in bf16)
    for p in params:
        if groups[-1] and sum(q.numel() for q in groups[-1]) + p.numel() > bucket_bytes // DTYPE.itemsize:
            groups.append([])
        groups[-1].append(p)

    def copy_cast() -> None:
        offset = 0
        for p in params:
            flat.narrow(0, offset, p.numel()).view(p.shape).copy_(p)
            offset += p.numel()

    def copy() -> None:
        offset = 0
        for b in wire.buckets:
            flat.narrow(0, offset, b.numel()).copy_(b)
            offset += b.numel()

    def split_copy() -> None:
        offset = 0
        for p in targets:
            p.copy_(flat.narrow(0, offset, p.numel()).view(p.shape))
            offset += p.numel()

    def export() -> None:
        for _ in source.named_weights(bucket_bytes=bucket_bytes, dtype=DTYPE):
            pass

    stages = {
        "cat+cast (torch)": lambda: [torch.cat([p.reshape(-1) for p in g]).to(DTYPE) for g in groups],
        "copy-cast (torch)": copy_cast,
        "export": export,
        "send": sync,
        "copy (torch)": copy,
        "receive": take,
        "split+copy (torch)": split_copy,
    }
    med = _medians(stages, device, repeats)
    rows = [(name, med[name]) for name in ("cat+cast (torch)", "copy-cast (torch)", "export", "send")]
    rows += [("pack (send - export)", med["send"] - med["export"])]
    rows += [(name, med[name]) for name in ("copy (torch)", "receive")]
    rows += [("unpack (receive - copy)", med["receive"] - med["copy (torch)"])]
    rows += [("split+copy (torch)", med["split+copy (torch)"])]
    return rows + [("bytes", float(num_bytes))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="0.6b", help="the Qwen3 shape")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--smoke", action="store_true", help="a tiny shape on CPU, to check the script")
    parser.add_argument("--bucket-mb", type=int, default=256, help="sync.bucket_mb")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (after one warm-up)")
    args = parser.parse_args()
    device = torch.device("cpu" if args.smoke else args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: leave out --device cuda")
    cfg = TINY if args.smoke else SHAPES[args.model]
    *rows, (_, num_bytes) = measure(cfg, device, args.bucket_mb << 20, args.repeats)
    gib = num_bytes / 2**30
    where = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"CPU, {torch.get_num_threads()} threads"
    )
    shape = "tiny" if args.smoke else f"Qwen3-{args.model}"
    print(
        f"sync packing, {shape} shape, fp32 -> bf16, {gib:.3f} GiB on the wire, {where}, bucket {args.bucket_mb} MiB"
    )
    print(f"{'stage':<24} {'ms':>9} {'ms/GiB':>8}")
    for name, seconds in rows:
        print(f"{name:<24} {seconds * 1e3:>9.2f} {seconds * 1e3 / gib:>8.2f}")


if __name__ == "__main__":
    main()
