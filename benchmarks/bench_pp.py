"""Pipeline-parallel training throughput and bubble fraction (rlloom/parallel/pp.py), one row per launch.

Launched with torchrun, one process per GPU; pp = the world size / `--dp`. Random weights built on
the meta device and materialised stage by stage (no rank holds the whole model), FSDP2 on each stage
(bf16 compute on CUDA, fp32 master weights, no reshard after forward), `--micro-batches` packed
micro-batches of `--tokens` tokens each (sequences of random lengths), loss over the second half of
each sequence. Timed: `Pipeline.forward_backward` (no optimizer step), one warm-up step, then
`--steps`. Bubble fraction = 1 - ideal / measured step time, where ideal = micro-batches x the
largest per-rank time of one micro-batch's forward + backward through the rank's stages run alone;
the (interleaved) 1F1B theory (pp - 1) / (v x micro-batches + pp - 1) is printed next to it (a
zero-bubble schedule should come out below it).

    torchrun --nproc-per-node 2 benchmarks/bench_pp.py --shape 8b --schedule 1f1b --append rows.jsonl
    torchrun --nproc-per-node 2 benchmarks/bench_pp.py --shape 8b --schedule interleaved --virtual-stages 2 \\
        --append rows.jsonl
    torchrun --nproc-per-node 2 benchmarks/bench_pp.py --shape dsv3-4l --first-stage-layers 3 --append rows.jsonl
    torchrun --nproc-per-node 2 benchmarks/bench_pp.py --smoke --schedule zero_bubble --virtual-stages 2  # CPU
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from bench_rollout import QWEN3_8B  # noqa: E402

from rlloom.models.args import ModelArgs
from rlloom.models.checkpoint import zero_persistent_buffers
from rlloom.models.model import CausalLM
from rlloom.parallel import ParallelDims, apply_ac, apply_fsdp, init_distributed
from rlloom.parallel.pp import apply_pp
from rlloom.parallel.pp_batches import PipeMicroBatch, pad_to_budget
from rlloom.parallel.pp_stages import split_layers

DSV3_4L = json.loads((Path(__file__).parents[1] / "rlloom/plan/configs/deepseek-v3/config.json").read_text())
DSV3_4L |= {"num_hidden_layers": 4, "n_routed_experts": 32, "n_group": 4, "topk_group": 2}  # 32 experts: fits
DSV3_4L.pop("quantization_config")
TINY = QWEN3_8B | {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6}
TINY |= {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
SHAPES = {"8b": QWEN3_8B, "dsv3-4l": DSV3_4L, "tiny": TINY}


def micro_batches(n: int, tokens: int, vocab: int, seed: int) -> list[PipeMicroBatch]:
    """`n` packed micro-batches of exactly `tokens` tokens, 1-4 sequences each, the second half scored."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        cuts = sorted(rng.sample(range(8, tokens - 8), rng.randint(0, 3)))
        bounds = [0, *cuts, tokens]
        lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        ids = torch.randint(0, vocab, (tokens,))
        positions = torch.cat([torch.arange(length) for length in lengths])
        selected = torch.cat(
            [torch.arange((a + b) // 2, b - 1) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        )
        cu = torch.tensor(bounds, dtype=torch.int32)
        out.append(PipeMicroBatch(ids, positions, cu, max(lengths), selected, ids[selected + 1]))
    return out


def stage_seconds(pipe, modules, mb: PipeMicroBatch, device: torch.device, repeats: int = 3) -> float:
    """This rank's time for one micro-batch's forward + backward through its stages, each run alone."""
    pipe.feed.micro_batches = [pad_to_budget(mb, pipe.budget, device)]
    total = 0.0
    for stage, module in zip(pipe.stages, modules, strict=True):
        hidden = torch.randn(1, pipe.budget, stage.submod.model.args.hidden_size, device=device)
        for i in range(repeats + 1):
            x = (
                pipe.feed.micro_batches[0].input_ids_1P
                if stage.is_first
                else hidden.to(pipe.dtype).requires_grad_()
            )
            sync(device)
            start = time.perf_counter()
            out = module(x, mb=torch.tensor([0]))
            out.backward(torch.ones_like(out) if stage.is_last else torch.randn_like(out))
            sync(device)
            if i:  # the first run warms up
                total += (time.perf_counter() - start) / repeats
    pipe.feed.micro_batches = []
    return total


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU (gloo): checks the script runs")
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--schedule", choices=["1f1b", "interleaved", "zero_bubble"], default="1f1b")
    ap.add_argument("--virtual-stages", type=int, default=1)
    ap.add_argument("--first-stage-layers", type=int, default=0)
    ap.add_argument("--last-stage-layers", type=int, default=0)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per micro-batch (the padding budget)")
    ap.add_argument("--ac", action="store_true", help="full activation checkpointing")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--append", type=Path, help="append the result row (JSON) to this file")
    a = ap.parse_args()
    if a.smoke:
        a.shape, a.tokens, a.micro_batches, a.steps = "tiny", 64, 4, 1
    device_type = "cuda" if torch.cuda.is_available() and not a.smoke else "cpu"
    init_distributed(device_type)
    device = (
        torch.device(device_type, torch.cuda.current_device())
        if device_type == "cuda"
        else torch.device("cpu")
    )
    dtype = torch.bfloat16 if device_type == "cuda" else torch.float32
    world = dist.get_world_size()
    dims = ParallelDims(world_size=world, pp=world // a.dp)
    dims.build_mesh(device_type)
    cfg = SHAPES[a.shape]
    with torch.device("meta"):
        model = CausalLM(ModelArgs.from_hf_config(cfg), cfg)

    def parallelize_stage(stage):
        stage.to_empty(device=device)
        zero_persistent_buffers(stage)  # DeepSeek-V3's router bias: garbage after to_empty
        with torch.no_grad():
            for name, p in stage.named_parameters():
                p.fill_(1.0) if "norm" in name else p.normal_(std=0.02)
        if a.ac:
            apply_ac(stage.model, "full")
        return apply_fsdp(
            stage, dims.dp_shard_mesh(), param_dtype=dtype, reshard_after_forward=False, layers_of=stage.model
        )

    modules, pipe = apply_pp(
        model,
        dims.pp_mesh(),
        schedule=a.schedule,
        budget=a.tokens,
        device=device,
        dtype=dtype,
        virtual_stages=a.virtual_stages,
        first_stage_layers=a.first_stage_layers,
        last_stage_layers=a.last_stage_layers,
        parallelize_stage=parallelize_stage,
    )
    mbs = micro_batches(
        a.micro_batches, a.tokens, model.args.vocab_size, seed=dims.dp_mesh().get_local_rank()
    )
    normaliser = float(sum(mb.positions_K.numel() for mb in mbs)) * a.dp

    def loss_fn(i: int, logp_K: torch.Tensor, entropy_K: torch.Tensor | None) -> torch.Tensor:
        return -logp_K.sum() / normaliser

    times = []
    for step in range(a.steps + 1):
        sync(device)
        dist.barrier()
        start = time.perf_counter()
        pipe.forward_backward(mbs, loss_fn)
        sync(device)
        if step:
            times.append(time.perf_counter() - start)
    step_s = sum(times) / len(times)
    busy = torch.tensor([stage_seconds(pipe, modules, mbs[0], device)], device=device)
    dist.all_reduce(busy, op=dist.ReduceOp.MAX)
    pp, v, n = dims.pp, a.virtual_stages, pipe.num_micro_batches(len(mbs))
    peak = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**30 if device_type == "cuda" else 0.0])
    peak = peak.to(device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    ranges = split_layers(
        model.args.num_layers,
        pp * v,
        first_stage_layers=a.first_stage_layers,
        last_stage_layers=a.last_stage_layers,
    )
    row = {
        "shape": a.shape,
        "schedule": a.schedule,
        "pp": pp,
        "dp": a.dp,
        "virtual_stages": v,
        "stage_layers": [len(r) for r in ranges],
        "micro_batches": n,
        "tokens_per_micro_batch": a.tokens,
        "ac": a.ac,
        "step_s": round(step_s, 4),
        "tokens_per_s": round(n * a.tokens * a.dp / step_s, 1),
        "bubble_measured": round(1 - n * float(busy) / step_s, 4),
        "bubble_theory_1f1b": round((pp - 1) / (v * n + pp - 1), 4),
        "peak_gib": round(float(peak), 2),
        "device": torch.cuda.get_device_name(device) if device_type == "cuda" else "cpu",
    }
    if dist.get_rank() == 0:
        print(json.dumps(row))
        if a.append:
            with a.append.open("a") as f:
                f.write(json.dumps(row) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
