"""Training-engine throughput: one optimizer step and one logprob pass over a packed batch (one table).

GPU (default): random weights of Qwen3-1.7B's shape (28 layers, hidden 2048, intermediate 6144,
16 heads, 8 KV heads, head dim 128, vocab 151936, tied embeddings) with fp32 master weights and
bf16 compute (one GPU: bf16 copies, no FSDP). The batch is sequences of lengths uniform in 256..4096 (fixed
seed, a quarter prompt, the rest response), packed into micro-batches of at most 16k tokens until
four micro-batches are full. Reported per pass: tokens/s, MFU (model FLOPs over 989 TFLOP/s, see
rlloom.observability.mfu), the bound (the pass's FLOPs at that peak: the time at 100% MFU) and peak
allocated memory; the first step is a warm-up and not timed.

`--vl`: a vision-language GRPO step, the Qwen2.5-VL-3B shape (bench_vlm.py; the 7B's 32-block tower,
trained) on prompts of one random `--image-size` picture each (448: 1,024 patches, 256 image tokens)
and responses of 256..1024 tokens, packed the same way; the FLOPs add the tower's (bench_vlm.tower_flops).

    python benchmarks/bench_train.py                 # needs a CUDA device
    python benchmarks/bench_train.py --ac off        # without activation checkpointing
    python benchmarks/bench_train.py --vl            # the VL step on one GPU
    python benchmarks/bench_train.py --tiny [--vl]   # a tiny shape on CPU, to check the script
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_rollout import QWEN3_17B  # noqa: E402  (the shapes live in one place)
from bench_vlm import QWEN2_5_VL_3B, image_prompts, tower_flops  # noqa: E402
from bench_vlm import TINY as TINY_VL  # noqa: E402

from rlloom.algorithms.losses import aggregate_loss_sum, loss_normalizer
from rlloom.config import TrainEngineConfig
from rlloom.data.types import RolloutBatch, Sample
from rlloom.engines.train.native import NativeTrainEngine
from rlloom.engines.train.native.flops import step_flops
from rlloom.engines.train.native.microbatch import pack_micro_batches
from rlloom.models.checkpoint import build_model
from rlloom.observability.mfu import H100_BF16_PEAK_FLOPS

TINY = QWEN3_17B | {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}
MODE = "token-mean"


def make_batch(
    min_len: int, max_len: int, budget: int, num_micro_batches: int, vocab: int, seed: int
) -> RolloutBatch:
    """Add random-length samples while first-fit decreasing still packs them into the micro-batches."""
    rng = random.Random(seed)
    lengths: list[int] = []
    while True:
        n = rng.randint(min_len, max_len)
        if len(pack_micro_batches(range(len(lengths) + 1), [*lengths, n], budget)) > num_micro_batches:
            break
        lengths.append(n)
    samples = []
    for n in lengths:
        p = max(1, n // 4)
        samples.append(
            Sample(
                prompt_ids=[rng.randrange(vocab) for _ in range(p)],
                response_ids=[rng.randrange(vocab) for _ in range(n - p)],
            )
        )
    return RolloutBatch(samples)


def make_vl_batch(
    config: dict, image_size: int, min_new: int, max_new: int, budget: int, num_micro_batches: int, seed: int
) -> RolloutBatch:
    """Picture prompts (one random picture each, transformers' image processor) with random responses
    of min_new..max_new tokens, added while first-fit decreasing still packs them into the micro-batches."""
    rng = random.Random(seed)
    samples: list[Sample] = []
    while True:
        [prompt], [images] = image_prompts(config, 1, image_size, seed=seed + len(samples))
        response = [rng.randrange(256) for _ in range(rng.randint(min_new, max_new))]
        lengths = [s.num_tokens for s in samples] + [len(prompt) + len(response)]
        if len(pack_micro_batches(range(len(lengths)), lengths, budget)) > num_micro_batches:
            return RolloutBatch(samples)
        samples.append(Sample(prompt_ids=prompt, response_ids=response, images=images))


def random_model(cfg: dict, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model(cfg, dtype=torch.float32, device=device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02) if p.ndim >= 2 else p.fill_(1.0)
    model.init_buffers()
    return model


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="tiny shape on CPU (checks the script runs)")
    parser.add_argument(
        "--ac", choices=["off", "full", "every_k"], default="full", help="activation checkpointing"
    )
    parser.add_argument("--budget", type=int, default=16384, help="max tokens per micro-batch")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2, help="timed optimizer steps (after one warm-up)")
    parser.add_argument("--optimizer-offload", action="store_true", help="AdamW step on CPU")
    parser.add_argument("--eager", action="store_true", help="no torch.compile of the decoder layers")
    parser.add_argument("--profile", action="store_true", help="also print the top kernels of one train step")
    parser.add_argument("--vl", action="store_true", help="a vision-language GRPO step (Qwen2.5-VL-3B shape)")
    parser.add_argument("--image-size", type=int, default=448, help="--vl: pixels a side of each picture")
    args = parser.parse_args()

    device = torch.device("cpu" if args.tiny else "cuda")
    if args.vl:
        cfg_model, name = (TINY_VL, "tiny VL") if args.tiny else (QWEN2_5_VL_3B, "Qwen2.5-VL-3B shape")
        budget = 512 if args.tiny else args.budget
        size, (min_new, max_new) = (56, (16, 64)) if args.tiny else (args.image_size, (256, 1024))
        batch = make_vl_batch(cfg_model, size, min_new, max_new, budget, args.micro_batches, seed=0)
    else:
        cfg_model, name = (TINY, "tiny") if args.tiny else (QWEN3_17B, "Qwen3-1.7B shape")
        min_len, max_len, budget = (16, 128, 256) if args.tiny else (256, 4096, args.budget)
        batch = make_batch(min_len, max_len, budget, args.micro_batches, cfg_model["vocab_size"], seed=0)
    cfg = TrainEngineConfig(
        lr=1e-6,
        max_tokens_per_micro_batch=budget,
        activation_checkpointing=args.ac,
        optimizer_offload=args.optimizer_offload,
        compile=not args.eager,
    )
    engine = NativeTrainEngine(cfg, random_model(cfg_model, device), device=device)
    mask = batch.response_mask()
    adv_B = torch.randn(len(batch))

    def loss_fn(logp_bT, entropy_bT, rows):
        adv = adv_B[rows].to(logp_bT.device)[:, None]
        return aggregate_loss_sum(-adv * logp_bT, mask[rows].to(logp_bT.device), MODE), {}

    normalizer = loss_normalizer(mask, MODE)
    train = []
    for i in range(args.steps + 1):
        metrics = engine.train_step(batch, loss_fn, loss_normalizer=normalizer)
        if i > 0:
            train.append(metrics)
    seconds = sum(m["time/train_step_s"] for m in train) / len(train)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    engine.forward_logprobs(batch)  # warm-up
    sync(device)
    start = time.perf_counter()
    engine.forward_logprobs(batch)
    sync(device)
    fwd_seconds = time.perf_counter() - start
    fwd_peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")

    tokens = batch.num_tokens
    seq_lens = [s.num_tokens for s in batch.samples]
    fwd_flops = step_flops(
        engine.model, seq_lens, int(mask.sum()), body_params=engine._body_params, backward=False
    )
    train_flops = step_flops(engine.model, seq_lens, int(mask.sum()), body_params=engine._body_params)
    pictures = ""
    if args.vl:  # the tower's FLOPs on every picture of the batch
        grid = torch.cat([s.images.grid_thw for s in batch.samples])
        fwd_flops += tower_flops(engine.model, grid, backward=False)
        train_flops += tower_flops(engine.model, grid)
        pictures = f", {len(grid)} pictures ({int(grid.prod(-1).sum())} patches)"
    peak = train[-1].get("memory/peak_allocated_gib", float("nan"))
    print(
        f"model {name}, {engine.compute_dtype}, ac={args.ac}, compile={not args.eager}, "
        f"optimizer_offload={args.optimizer_offload}, device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}"
    )
    print(
        f"batch: {len(batch)} sequences, {tokens} tokens ({int(mask.sum())} response), "
        f"{int(train[-1]['train/num_micro_batches'])} micro-batches of <= {budget} tokens{pictures}"
    )
    print(f"{'pass':<26}{'seconds':>10}{'bound s':>10}{'tokens/s':>12}{'MFU':>8}{'peak GiB':>10}")
    for row, secs, flops, mem in (
        ("train_step (fwd+bwd+opt)", seconds, train_flops, peak),
        ("forward_logprobs", fwd_seconds, fwd_flops, fwd_peak),
    ):
        bound = flops / H100_BF16_PEAK_FLOPS
        mfu = f"{bound / secs:.1%}" if device.type == "cuda" else "-"
        print(f"{row:<26}{secs:>10.3f}{bound:>10.3f}{tokens / secs:>12.0f}{mfu:>8}{mem:>10.2f}")
    if args.profile:
        print_profile(engine, batch, loss_fn, normalizer, device)


def print_profile(engine: NativeTrainEngine, batch: RolloutBatch, loss_fn, normalizer: float, device) -> None:
    """Where one train step's device time goes: the top kernels, and the device-busy fraction."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        engine.train_step(batch, loss_fn, loss_normalizer=normalizer)
        sync(device)
    wall = time.perf_counter() - start
    # Operator-level rows (aten::...) carry the device time of the kernels they launch, so listing
    # both would count each kernel twice: show operators only.
    events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    attr = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    busy = sum(getattr(e, attr) for e in events) / 1e6
    print(
        f"\nprofiled train step: wall {wall:.3f} s, operators on the device {busy:.3f} s ({busy / wall:.0%} busy)"
    )
    print(f"{'operator':<70}{'seconds':>10}{'share':>8}{'calls':>8}")
    for e in sorted(events, key=lambda e: getattr(e, attr), reverse=True)[:15]:
        secs = getattr(e, attr) / 1e6
        print(f"{e.key[:69]:<70}{secs:>10.3f}{secs / max(busy, 1e-9):>8.1%}{e.count:>8}")
    if device.type != "cuda":
        return
    # Kernels, Triton and Inductor ones included (no aten operator carries their time).
    # Not the GPU-side ranges of annotations (`Optimizer.step#AdamW.step` spans AdamW's kernels).
    kernels = [
        e
        for e in prof.key_averages()
        if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
    ]
    kbusy = sum(e.self_device_time_total for e in kernels) / 1e6
    print(f"\nkernels: {kbusy:.3f} s on the device ({kbusy / wall:.0%} of the wall time)")
    print(f"{'kernel':<70}{'seconds':>10}{'share':>8}{'calls':>8}")
    for e in sorted(kernels, key=lambda e: e.self_device_time_total, reverse=True)[:25]:
        secs = e.self_device_time_total / 1e6
        print(f"{e.key[:69]:<70}{secs:>10.3f}{secs / max(kbusy, 1e-9):>8.1%}{e.count:>8}")


if __name__ == "__main__":
    main()
