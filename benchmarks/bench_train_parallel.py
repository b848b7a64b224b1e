"""Training-engine throughput in a parallel layout (TP/SP, EP, CP, FSDP), one row per launch.

Launched with torchrun, one process per GPU; the layout is `--tp` / `--ep` / `--cp` (data
parallelism is what the world size leaves). Random weights built from a config (no downloads), fp32
master weights, bf16 compute, activation checkpointing full (`--ac off` turns it off), packed
sequences of `--seq-len` tokens (one per micro-batch), `--micro-batches` per data-parallel rank.
One warm-up step, then `--steps` timed. Reported (rank 0): layout, model shape, tokens/s (global and
per GPU), MFU on active parameters (routed experts count top_k / num_experts; over every GPU of the
layout, 989 TFLOP/s each), peak GPU memory (max over ranks) beside `rlloom.plan.memory.estimate`'s
prediction for the same layout and workload (no rollout engine; 3/4 of each sequence is response),
peak host RSS (max over ranks), and the first step's gradient norm: every launch starts from the
same weights, so launches of the same global batch (`--micro-batches` x data-parallel ranks) must
agree on it whatever the layout (within bf16 noise on GPU), a correctness check in the same table.
`--append FILE` adds the row as a JSON line; `--table FILE` prints every row of that file as one
table. `--grad-parts` takes no step and prints, instead, the gradient norm of each document of the
batch alone and of all of them, by parameter group (embedding, head, norms, attention keys/values, queries/output, MLP), with the
cosine between the first two documents' gradients: two layouts that disagree on "grad norm 0"
then show whether one document's gradient or their combination differs, and where.
`--memory-peak` records the CUDA allocator through the first timed step and prints, per rank, the
peak and the allocation sites (rlloom's innermost frame) of what was live then.
`--fake-ranks N` runs rank 0 of an N-rank layout in one process on one GPU, over torch's fake
process group: collectives move no data (their outputs are left as allocated), so the values, the
gradient norm and the speed mean nothing, but every tensor rank 0 allocates has its real shape and
lifetime. It measures a layout's memory (and `--memory-peak`'s holders) without its GPUs: data
parallelism and CP (whose gathered keys and values are whatever the memory held; a non-finite loss
would stop the step), not TP or EP.

Shapes: `30b-a3b-8l` (Qwen3-30B-A3B width, 8 of 48 layers, 128 experts), `30b-a3b-24l` (24 layers,
~15.5B parameters: fp32 master + Adam do not fit one H200; use --optimizer-offload-fraction),
`8b` (Qwen3-8B dense), `dsv3-2l` (DeepSeek-V3 width, 2 layers: 1 dense + 1 MoE of 256 experts,
MLA). The model is built on the GPU in fp32 before it is sharded, so the whole
model must fit one GPU once (the 24-layer MoE does: ~62 GB).

    torchrun --nproc-per-node 1 benchmarks/bench_train_parallel.py --shape 30b-a3b-8l --append rows.jsonl
    torchrun --nproc-per-node 2 benchmarks/bench_train_parallel.py --shape 30b-a3b-8l --ep 2 --append rows.jsonl
    torchrun --nproc-per-node 2 benchmarks/bench_train_parallel.py --shape 30b-a3b-24l --ep 2 \\
        --optimizer-offload-fraction 0.5 --append rows.jsonl
    torchrun --nproc-per-node 2 benchmarks/bench_train_parallel.py --shape 8b --tp 2 --append rows.jsonl
    torchrun --nproc-per-node 2 benchmarks/bench_train_parallel.py --shape 8b --append rows.jsonl   # dp=2
    torchrun --nproc-per-node 2 benchmarks/bench_train_parallel.py --shape 8b --cp 2 --seq-len 65536 \\
        --micro-batches 1 --append rows.jsonl   # one 64k-token sequence cut over 2 GPUs
    python benchmarks/bench_train_parallel.py --table rows.jsonl
    python benchmarks/bench_train_parallel.py --shape 8b --cp 2 --seq-len 65536 --micro-batches 1 \\
        --steps 1 --fake-ranks 2 --memory-peak   # cp=2's rank 0 on one GPU: memory only
    torchrun --nproc-per-node 2 benchmarks/bench_train_parallel.py --smoke --tp 2   # CPU, gloo, tiny
    torchrun --nproc-per-node 2 benchmarks/bench_train_parallel.py --smoke --cp 2
    torchrun --nproc-per-node 2 benchmarks/bench_train_parallel.py --tiny --shape 8b --cp 2 --micro-batches 2 \\
        --seq-len 4096 --grad-parts   # the same tiny model on 2 GPUs: a minute, compile included
    torchrun --nproc-per-node 2 benchmarks/bench_train_parallel.py --tiny --shape dsv3-2l --tp 2 --micro-batches 1 \\
        --seq-len 4096 --grad-parts   # MLA under TP, compiled, against the same with --tp 1 (dp=2)
    torchrun --nproc-per-node 2 benchmarks/bench_train_parallel.py --shape 8b --cp 2 --seq-len 65536 \\
        --micro-batches 2 --grad-parts   # against the same without --cp 2 and with --micro-batches 1
    torchrun --nproc-per-node 2 benchmarks/bench_train_parallel.py --shape 8b --cp 2 --seq-len 65536 \\
        --micro-batches 1 --steps 1 --memory-peak   # what holds each rank's peak (GPU)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from bench_moe import DEEPSEEK_V3_2L, QWEN3_30B_A3B_8L, TINY_DEEPSEEK  # noqa: E402
from bench_rollout import QWEN3_8B  # noqa: E402

from rlloom.algorithms.losses import aggregate_loss_sum, loss_normalizer
from rlloom.config import TrainEngineConfig
from rlloom.data.types import RolloutBatch, Sample
from rlloom.engines.train.native import NativeTrainEngine
from rlloom.models.args import ModelArgs
from rlloom.models.checkpoint import build_model
from rlloom.observability.memory import allocation_trace, peak_holders, record_allocations
from rlloom.parallel import ParallelDims, grad_norm, init_distributed
from rlloom.plan.counts import model_costs
from rlloom.plan.memory import Hardware, Layout, Workload, estimate

SHAPES = {
    "30b-a3b-8l": QWEN3_30B_A3B_8L,
    "30b-a3b-24l": QWEN3_30B_A3B_8L | {"num_hidden_layers": 24},
    "8b": QWEN3_8B,
    "dsv3-2l": DEEPSEEK_V3_2L,
}
TINY_MOE = QWEN3_30B_A3B_8L | {
    "vocab_size": 512,
    "hidden_size": 64,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 8,
    "num_experts_per_tok": 2,
}
COLUMNS = (
    "layout", "gpus", "shape", "tokens", "tok/s", "tok/s/GPU", "MFU(active)", "GPU GiB", "predicted GiB",
    "host GiB", "grad norm 0",
)  # fmt: skip


def random_model(config: dict, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)  # every rank builds the same weights
    model = build_model(config, dtype=torch.float32, device=device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02) if p.ndim >= 2 else p.fill_(1.0)
    model.init_buffers()
    return model


def packed_batch(num_samples: int, seq_len: int, vocab: int) -> RolloutBatch:
    rng = random.Random(0)
    samples = []
    for _ in range(num_samples):
        prompt = max(1, seq_len // 4)
        samples.append(
            Sample(
                prompt_ids=[rng.randrange(vocab) for _ in range(prompt)],
                response_ids=[rng.randrange(vocab) for _ in range(seq_len - prompt)],
            )
        )
    return RolloutBatch(samples)


def predicted_gib(config: dict, dims: ParallelDims, args: argparse.Namespace, seq_len: int) -> float:
    """The memory model's training peak per GPU for this launch's layout and workload."""
    layout = Layout(
        tp=dims.tp, cp=dims.cp, ep=dims.ep, dp=dims.dp_size, offload_fraction=args.optimizer_offload_fraction
    )
    work = Workload(
        max_tokens_per_gpu=seq_len,
        recompute="full" if args.ac == "full" else "none",
        response_fraction=0.75,
        micro_batches=args.micro_batches,
        compiled=not args.eager,
        colocated_rollout=False,
    )
    gpu_gb = torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else 80.0
    hardware = Hardware(gpus=dims.world_size, gpu_memory_gb=gpu_gb)
    return estimate(model_costs(ModelArgs.from_hf_config(config)), layout, hardware, work).gpu_memory_gb


def init_fake_ranks(world: int) -> tuple[int, int]:
    """Rank 0 of `world` ranks over torch's fake process group (collectives move nothing)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    return 0, world


def run(args: argparse.Namespace) -> dict:
    device_type = "cpu" if args.smoke else "cuda"
    rank, world = init_fake_ranks(args.fake_ranks) if args.fake_ranks else init_distributed(device_type)
    device = (
        torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    )
    tiny = args.smoke or args.tiny
    config = TINY_MOE if tiny else SHAPES[args.shape]
    if tiny and args.shape == "dsv3-2l":
        config = TINY_DEEPSEEK
    elif tiny and args.shape == "8b":
        config = TINY_MOE | {
            "model_type": "qwen3",
            "architectures": ["Qwen3ForCausalLM"],
            "intermediate_size": 128,
        }
    seq_len = args.seq_len or (64 if tiny else 4096)
    dims = ParallelDims(world_size=world, tp=args.tp, cp=args.cp, ep=args.ep)
    offload = args.optimizer_offload_fraction > 0
    cfg = TrainEngineConfig(
        lr=1e-6,
        max_tokens_per_micro_batch=seq_len,
        activation_checkpointing=args.ac,
        share_prompts=False,  # every sample has its own prompt; CP needs plain packed documents
        compile=not args.eager,
        optimizer_offload=offload,
        optimizer_offload_fraction=args.optimizer_offload_fraction if offload else 1.0,
    )
    start = time.perf_counter()

    def progress(what: str) -> None:  # rank 0, to stderr: where a slow or stuck launch is
        if rank == 0:
            print(f"[{time.perf_counter() - start:7.1f} s] {what}", file=sys.stderr, flush=True)

    engine = NativeTrainEngine(cfg, random_model(config, device), device=device, parallel_dims=dims)
    progress("engine built")
    batch = packed_batch(args.micro_batches * dims.dp_size, seq_len, config["vocab_size"])
    mask = batch.response_mask()
    adv_B = torch.randn(len(batch), generator=torch.Generator().manual_seed(1))
    loss_fn = policy_loss(adv_B, mask)
    normalizer = loss_normalizer(mask, "token-mean")
    if args.grad_parts:
        grad_parts(engine, batch, adv_B, mask, normalizer, rank)
        return {}
    steps = []
    for i in range(args.steps + 1):
        record = args.memory_peak and i == 1  # the first timed step (the warm-up compiles)
        if record:
            baseline = torch.cuda.memory_allocated(device)
            record_allocations(True)
        steps.append(engine.train_step(batch, loss_fn, loss_normalizer=normalizer))
        progress(f"step {i}{' (warm-up)' if i == 0 else ''}: {steps[-1]['time/train_step_s']:.2f} s")
        if record:
            peak, holders = peak_holders(allocation_trace(device))
            record_allocations(False)
            print_memory_peak(rank, baseline, peak, holders)
    timed = steps[1:]
    seconds = sum(m["time/train_step_s"] for m in timed) / len(timed)
    layout = ", ".join(f"{k}={v}" for k, v in dims.degrees().items() if v > 1) or "1 GPU"
    if args.ac != "full":
        layout += f", AC {args.ac}"
    if offload:
        layout += f", CPU Adam {args.optimizer_offload_fraction:g}"
    if args.fake_ranks:
        layout += ", rank 0 alone (memory only)"
        skipped = sum(int(m["train/skipped_step"]) for m in steps)
        if skipped:  # a skipped step allocates no AdamW state: the peak would be too low
            layout += f", {skipped} steps skipped (no optimizer state)"
    row = {
        "layout": layout,
        "gpus": world,
        "shape": f"{'tiny ' + config['model_type'] if tiny else args.shape} ({config['num_hidden_layers']} layers)",
        "tokens": batch.num_tokens,
        "tok/s": batch.num_tokens / seconds,
        "tok/s/GPU": batch.num_tokens / seconds / world,
        "MFU(active)": timed[-1].get("perf/mfu", float("nan")),
        "GPU GiB": timed[-1].get("memory/peak_allocated_gib", float("nan")),
        "predicted GiB": predicted_gib(config, dims, args, seq_len),
        "host GiB": timed[-1].get("memory/peak_rss_gib", float("nan")),
        # the first step's gradient norm (same weights everywhere): launches of one global batch
        # (micro-batches x data-parallel ranks) must agree whatever the layout, within bf16 noise
        "grad norm 0": steps[0]["train/grad_norm"],
    }
    if rank == 0:
        print_table([row])
        if args.append:
            with open(args.append, "a") as f:
                f.write(json.dumps(row) + "\n")
    return row


def print_memory_peak(rank: int, baseline: int, peak: int, holders: list[tuple[str, int]]) -> None:
    """Every rank's peak of the recorded step and what held it, printed by rank 0."""
    mine = (baseline, peak, holders)
    every = [mine] * dist.get_world_size()
    if dist.get_backend() == "fake":
        every = [mine]  # the other ranks are not run
    else:
        dist.all_gather_object(every, mine)
    if rank:
        return
    for r, (base, top, sites) in enumerate(every):
        print(
            f"rank {r}: {base / 2**30:.1f} GiB allocated before the step, peak {(base + top) / 2**30:.1f} GiB; "
            f"live at the peak, from the step (GiB, where allocated):"
        )
        for site, size in sites:
            print(f"  {size / 2**30:8.2f}  {site}")


def policy_loss(adv_B: torch.Tensor, mask: torch.Tensor):  # noqa: ANN201
    """The benchmark's loss: token-mean of -advantage x logp over the response tokens."""

    def loss_fn(logp_bT, entropy_bT, rows):
        adv = adv_B[rows].to(logp_bT.device)[:, None]
        return aggregate_loss_sum(-adv * logp_bT, mask[rows].to(logp_bT.device), "token-mean"), {}

    return loss_fn


def grad_parts(
    engine: NativeTrainEngine, batch: RolloutBatch, adv_B, mask, normalizer: float, rank: int
) -> None:
    """Gradient norms of each document alone (its advantage kept, the others' zeroed) and of all,
    by parameter group; printed on rank 0 as one table (no optimizer step)."""
    named = list(engine.module.named_parameters())
    groups = {
        "embedding": [q for n, q in named if "tok_embeddings" in n],
        "head": [q for n, q in named if n.endswith("output.weight")],
        "norms": [q for n, q in named if q.ndim == 1],
    }
    grouped = {id(q) for qs in groups.values() for q in qs}
    matrices = [(n, q) for n, q in named if id(q) not in grouped]
    # keys and values reach the other cp ranks (all-gather; their gradients come back by
    # reduce-scatter), queries and the output projection stay local: splitting them says which
    kv = {id(q) for n, q in matrices if n.split(".")[-2] in ("wk", "wv", "wkv_a", "wkv_b")}
    groups["attn k, v"] = [q for _, q in matrices if id(q) in kv]
    groups["attn q, o"] = [q for n, q in matrices if ".attention." in n and id(q) not in kv]
    grouped |= {id(q) for q in groups["attn k, v"] + groups["attn q, o"]}
    groups["mlp"] = [q for _, q in matrices if id(q) not in grouped]
    groups["all"] = [q for _, q in named]
    parts = {f"doc {i}": [i] for i in range(len(batch))} | {"all docs": list(range(len(batch)))}
    norms: dict[str, dict[str, float]] = {}
    for label, keep in parts.items():
        adv = torch.zeros_like(adv_B)
        adv[keep] = adv_B[keep]
        engine.forward_backward(batch, policy_loss(adv, mask), loss_normalizer=normalizer)
        norms[label] = {
            g: grad_norm(qs, ep_params=engine._expert_params, ep_group=engine.layout.ep_group).item()
            for g, qs in groups.items()
        }
        engine.optimizer.zero_grad()
    if rank:
        return
    labels = list(parts)
    print(f"{'parameters':<12}" + "".join(f"{label:>14}" for label in labels) + f"{'cos(doc 0, 1)':>15}")
    for g in groups:
        a, b, ab = norms["doc 0"][g], norms.get("doc 1", {}).get(g, 0.0), norms["all docs"][g]
        # |a + b|^2 = |a|^2 + |b|^2 + 2 a.b (exact for two documents)
        cos = (ab**2 - a**2 - b**2) / (2 * a * b) if len(batch) == 2 and a * b > 0 else float("nan")
        print(f"{g:<12}" + "".join(f"{norms[label][g]:>14.5f}" for label in labels) + f"{cos:>15.4f}")


WIDTHS = {"layout": -34, "shape": -20, "gpus": 5, "predicted GiB": 14, "grad norm 0": 12}


def print_table(rows: list[dict]) -> None:
    def cell(column: str, text: str) -> str:
        width = WIDTHS.get(column, 12)
        return f"{text:<{-width}}" if width < 0 else f"{text:>{width}}"

    print(" ".join(cell(c, c) for c in COLUMNS))
    for r in rows:
        texts = {
            c: f"{r[c]:.3f}"
            if c in ("MFU(active)", "grad norm 0")
            else f"{r[c]:.1f}"
            if isinstance(r.get(c), float)
            else str(r.get(c, "-"))  # rows appended before a column existed
            for c in COLUMNS
        }
        print(" ".join(cell(c, texts[c]) for c in COLUMNS))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="30b-a3b-8l")
    parser.add_argument("--tp", type=int, default=1, help="parallel.tp")
    parser.add_argument("--ep", type=int, default=1, help="parallel.ep")
    parser.add_argument(
        "--cp", type=int, default=1, help="parallel.cp (each packed sequence cut over cp ranks)"
    )
    parser.add_argument(
        "--seq-len",
        type=int,
        default=0,
        help="tokens per packed sequence (= micro-batch); 4096, or 64 with --smoke / --tiny",
    )
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches per data-parallel rank")
    parser.add_argument("--steps", type=int, default=2, help="timed optimizer steps (after one warm-up)")
    parser.add_argument(
        "--optimizer-offload-fraction", type=float, default=0.0, help="CPU Adam for this fraction (0 = off)"
    )
    parser.add_argument("--ac", choices=["full", "off"], default="full", help="activation checkpointing")
    parser.add_argument("--eager", action="store_true", help="no torch.compile of the decoder layers")
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU (gloo): checks the script")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="the --smoke model on the GPUs: NCCL, bf16, the GPU kernels, compile",
    )
    parser.add_argument("--append", default="", help="append the row as a JSON line to this file")
    parser.add_argument("--table", default="", help="print the rows of this JSON-lines file and exit")
    parser.add_argument(
        "--memory-peak",
        action="store_true",
        help="GPU: record the allocator in the first timed step; print each rank's peak and what held it",
    )
    parser.add_argument(
        "--fake-ranks",
        type=int,
        default=0,
        help="run rank 0 of this many ranks alone over a fake process group: its memory, nothing else",
    )
    parser.add_argument(
        "--grad-parts", action="store_true", help="no step: each document's gradient norm, by parameter group"
    )
    args = parser.parse_args()
    if args.table:
        print_table([json.loads(line) for line in Path(args.table).read_text().splitlines() if line.strip()])
        return
    if args.memory_peak and args.smoke:
        parser.error("--memory-peak records the CUDA allocator: run it on GPUs (--tiny for the small model)")
    if args.fake_ranks and (args.fake_ranks < 2 or "WORLD_SIZE" in os.environ):
        parser.error("--fake-ranks N (N >= 2) runs one process: start it with python, not torchrun")
    if args.fake_ranks and args.ep > 1:
        parser.error("--fake-ranks with --ep: the experts' token counts come from the other ranks (not run)")
    if args.fake_ranks and args.tp > 1:  # tried on one H200: the loss check stopped the first step
        parser.error(
            "--fake-ranks with --tp: every activation passes TP's collectives, whose outputs are left "
            "as allocated, so the loss is NaN and the step stops"
        )
    if args.fake_ranks and args.grad_parts:
        parser.error("--fake-ranks moves no data between ranks: --grad-parts would mean nothing")
    if args.smoke:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        run(args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
