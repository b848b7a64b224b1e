"""Measured training-step GPU memory beside `rlloom plan --check` predictions (one table).

For each case: random weights of a dense Qwen3 shape or of Qwen3-30B-A3B's MoE width with 4 or 8
of its 48 layers (`qwen3-30b-a3b-4l`, `-8l`: benchmarks/bench_moe.py's config), rlloom's training
engine on one GPU (no FSDP: fp32 master weights, bf16 compute on their copies, the default
torch.compile of the decoder layers), a batch of 1024-token sequences (a quarter prompt) that fills exactly MICRO_BATCHES micro-batches of TOKENS
tokens (default 1; from 2 on, backward runs beside the accumulated gradients), and two optimizer
steps, each case in a fresh process; the measured peak is torch.cuda.max_memory_allocated of the
second step (AdamW moments exist by then). The prediction is `rlloom.plan.memory.estimate` for the
same single-GPU layout (tp=pp=cp=ep=1, dp=1) without a rollout engine, with the head computing
logprobs of 3/4 of the tokens; error = predicted / measured - 1.

    python benchmarks/bench_plan_memory.py            # the dense cases (each under 65 GB predicted)
    python benchmarks/bench_plan_memory.py --moe      # the MoE cases (each under 70 GB predicted)
    python benchmarks/bench_plan_memory.py --eager    # without torch.compile
    python benchmarks/bench_plan_memory.py --case qwen3-4b:8192:full:1.0   # model:tokens:ac:offload
    python benchmarks/bench_plan_memory.py --case qwen3-1.7b:8192:off:0.5:2  # ...:micro_batches
    python benchmarks/bench_plan_memory.py --tiny     # tiny dense and MoE shapes on CPU: checks the script runs

DeepSeek-V3's width with 2 layers (bench_moe.py's DEEPSEEK_V3_2L, 13.9B parameters) is not a case:
its predicted peak on one GPU is 168 GB even with offload 1.0 (fp32 shards and gradients alone take
104 GB), so it needs expert parallelism over several GPUs.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_moe import QWEN3_30B_A3B_8L  # noqa: E402
from bench_moe import TINY as TINY_MOE  # noqa: E402

from rlloom.algorithms.losses import aggregate_loss_sum, loss_normalizer
from rlloom.config import TrainEngineConfig
from rlloom.data.types import RolloutBatch, Sample
from rlloom.engines.train.native import NativeTrainEngine
from rlloom.models.args import ModelArgs
from rlloom.models.checkpoint import build_model
from rlloom.plan.counts import model_costs
from rlloom.plan.inputs import Hardware, Layout, Workload
from rlloom.plan.memory import GB, estimate

QWEN3_06B = json.loads((Path(__file__).parents[1] / "rlloom/plan/configs/qwen3-0.6b/config.json").read_text())
SHAPES = {
    "qwen3-0.6b": QWEN3_06B,
    "qwen3-1.7b": QWEN3_06B | {"hidden_size": 2048, "intermediate_size": 6144, "num_attention_heads": 16},
    "qwen3-4b": QWEN3_06B
    | {"hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32},
    "tiny": QWEN3_06B
    | {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "head_dim": 16,
    },
    "qwen3-30b-a3b-4l": QWEN3_30B_A3B_8L | {"num_hidden_layers": 4},
    "qwen3-30b-a3b-8l": QWEN3_30B_A3B_8L,
    "tiny-moe": TINY_MOE,
}
DEFAULT_CASES = (
    "qwen3-0.6b:8192:off:0",
    "qwen3-0.6b:8192:full:0",
    "qwen3-1.7b:16384:full:0",
    "qwen3-1.7b:16384:full:1.0",
    "qwen3-1.7b:8192:off:0.5",
    "qwen3-4b:8192:full:0.5",
    "qwen3-4b:8192:full:1.0",
    "qwen3-1.7b:16384:full:1.0:2",
    "qwen3-1.7b:8192:off:0.5:2",
)
MOE_CASES = (
    "qwen3-30b-a3b-4l:8192:full:0",
    "qwen3-30b-a3b-4l:8192:full:1.0",
    "qwen3-30b-a3b-4l:8192:full:0.5:2",
    "qwen3-30b-a3b-4l:16384:off:0.5",
    "qwen3-30b-a3b-8l:8192:full:0.5",
)
"""Each under 70 GB predicted (one 80 GB H100 suffices) and under ~50 GB of host memory for the
offloaded master weights, moments and gradient staging (16 bytes an offloaded parameter)."""
TINY_CASES = ("tiny:512:off:0", "tiny:512:full:1.0:2", "tiny-moe:512:full:0.5:2", "tiny-moe:512:off:1.0")
SEQ_LEN = 1024
RESPONSE_FRACTION = 0.75
"""Of each sequence, the response (whose logprobs the head computes); the rest is the prompt."""


def make_batch(tokens: int, vocab: int, micro_batches: int = 1, seed: int = 0) -> RolloutBatch:
    rng = random.Random(seed)
    lengths = [SEQ_LEN] * (tokens // SEQ_LEN) + ([tokens % SEQ_LEN] if tokens % SEQ_LEN else [])
    lengths *= micro_batches
    return RolloutBatch(
        [
            Sample(
                prompt_ids=[rng.randrange(vocab) for _ in range(max(1, n // 4))],
                response_ids=[rng.randrange(vocab) for _ in range(n - max(1, n // 4))],
            )
            for n in lengths
        ]
    )


def measure(
    shape: dict,
    tokens: int,
    ac: str,
    offload: float,
    micro_batches: int,
    device: torch.device,
    compile_: bool,
) -> float:
    """Peak allocated GB of the second train step (nan off CUDA)."""
    cfg = TrainEngineConfig(
        lr=1e-6,
        max_tokens_per_micro_batch=tokens,
        activation_checkpointing=ac,
        optimizer_offload=offload > 0,
        optimizer_offload_fraction=offload or 1.0,
        compile=compile_,
        share_prompts=False,
    )
    torch.manual_seed(0)
    model = build_model(shape, dtype=torch.float32, device=device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02) if p.ndim >= 2 else p.fill_(1.0)
    model.init_buffers()
    engine = NativeTrainEngine(cfg, model, device=device)
    batch = make_batch(tokens, shape["vocab_size"], micro_batches)
    mask = batch.response_mask()

    def loss_fn(logp_bT, entropy_bT, rows):
        return aggregate_loss_sum(-logp_bT, mask[rows].to(logp_bT.device), "token-mean"), {}

    peak = float("nan")
    for _ in range(2):
        metrics = engine.train_step(batch, loss_fn, loss_normalizer=loss_normalizer(mask, "token-mean"))
        peak = metrics.get("memory/peak_allocated_gib", float("nan"))
    return peak


def predict(
    shape: dict,
    tokens: int,
    ac: str,
    offload: float,
    micro_batches: int,
    gpu_gb: float,
    compiled: bool,
) -> tuple[float, str]:
    costs = model_costs(ModelArgs.from_hf_config(shape))
    work = Workload(
        max_tokens_per_gpu=tokens,
        recompute="none" if ac == "off" else "full",
        logprob_chunk_tokens=TrainEngineConfig().logprob_chunk_tokens,
        response_fraction=RESPONSE_FRACTION,
        micro_batches=micro_batches,
        compiled=compiled,
        colocated_rollout=False,
    )
    est = estimate(costs, Layout(offload_fraction=offload), Hardware(gpus=1, gpu_memory_gb=gpu_gb), work)
    bd = est.breakdown
    parts = f"p{bd.params:.1f} g{bd.grads:.1f} o{bd.optimizer:.1f} a{bd.activations:.1f} b{bd.buffers:.1f}"
    parts += f" at {est.peak_phase}"
    return est.gpu_memory_gb, parts


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--case", action="append", help="model:tokens:ac:offload[:micro_batches] (repeatable)"
    )
    parser.add_argument("--eager", action="store_true", help="no torch.compile of the decoder layers")
    parser.add_argument("--moe", action="store_true", help="the MoE cases instead of the dense ones")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on CPU (checks the script runs)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # measure one case in this process
    args = parser.parse_args()
    if args.one:
        model, tokens, ac, offload, micro_batches = parse_case(args.one)
        device = torch.device("cpu" if model.startswith("tiny") else "cuda")
        print(
            json.dumps(
                {"peak": measure(SHAPES[model], tokens, ac, offload, micro_batches, device, not args.eager)}
            )
        )
        return
    device = torch.device("cpu" if args.tiny else "cuda")
    cases = args.case or list(TINY_CASES if args.tiny else MOE_CASES if args.moe else DEFAULT_CASES)
    gpu_gb = torch.cuda.get_device_properties(0).total_memory / GB if device.type == "cuda" else 80.0
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"device {name} ({gpu_gb:.1f} GB), compile={not args.eager and device.type == 'cuda'}")
    print(f"{'case':<30}{'predicted':>10}{'measured':>10}{'error':>8}  predicted parts (GB)")
    for case in cases:
        model, n, ac, f, micro_batches = parse_case(case)
        predicted, parts = predict(SHAPES[model], n, ac, f, micro_batches, gpu_gb, compiled=not args.eager)
        measured = _measure_in_child(case, args.eager)
        error = f"{predicted / measured - 1:+.1%}" if measured == measured else "-"
        print(f"{case:<30}{predicted:>10.2f}{measured:>10.2f}{error:>8}  {parts}", flush=True)


def parse_case(case: str) -> tuple[str, int, str, float, int]:
    """model:tokens:ac:offload[:micro_batches] -> (model, tokens, ac, offload, micro_batches)."""
    model, tokens, ac, offload, *rest = case.split(":")
    return model, int(tokens), ac, float(offload), int(rest[0]) if rest else 1


def _measure_in_child(case: str, eager: bool) -> float:
    # A fresh process per case: clean allocator statistics, and torch.compile caches of one model
    # never push another model's layers past dynamo's recompile limit (into eager mode).
    cmd = [sys.executable, __file__, "--one", case] + (["--eager"] if eager else [])
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return float(json.loads(out.strip().splitlines()[-1])["peak"])


if __name__ == "__main__":
    main()
