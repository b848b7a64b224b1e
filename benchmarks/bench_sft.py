"""Supervised fine-tuning throughput beside the RL train step, on the same engine and batch (one table).

`rlloom sft` drives the training engine that RL drives with another loss (rlloom.algorithms.sft: the
NLL of the masked tokens), so an SFT step should cost what an RL policy update of the same tokens
costs. This times both on one packed batch: the SFT step (the assistant tokens are each sequence's
last three quarters, the loss mask all ones there) and the RL step (a policy-gradient loss,
-advantage x logprob, on the same tokens), after a warm-up step each. Reported per step: seconds,
tokens/s (every token the model computes), trained tokens/s (the masked ones) and MFU (model FLOPs
over 989 TFLOP/s, the H100/H200 dense bf16 peak; see rlloom.observability.mfu).

GPU (default): random weights of Qwen3-1.7B's shape with fp32 master weights and bf16 compute (one
GPU: bf16 copies, no FSDP), sequences of 256..4096 tokens packed into four micro-batches of at most
16k tokens (bench_train.py's batch).

    python benchmarks/bench_sft.py           # needs a CUDA device
    python benchmarks/bench_sft.py --tiny    # a tiny shape on CPU, to check the script
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_rollout import QWEN3_17B  # noqa: E402  (the shapes live in one place)
from bench_train import TINY, make_batch, random_model  # noqa: E402

from rlloom.algorithms.aggregation import aggregate_loss_sum, loss_normalizer
from rlloom.algorithms.sft import make_sft_loss_fn, sft_normalizer
from rlloom.config import TrainEngineConfig
from rlloom.data.types import RolloutBatch
from rlloom.engines.train.native import NativeTrainEngine
from rlloom.engines.train.native.flops import step_flops
from rlloom.observability.mfu import H100_BF16_PEAK_FLOPS

MODE = "token-mean"


def timed_steps(
    engine: NativeTrainEngine, batch: RolloutBatch, loss_fn, normalizer: float, steps: int
) -> float:
    """Mean seconds of `steps` optimizer steps after one warm-up step."""
    seconds = []
    for i in range(steps + 1):
        metrics = engine.train_step(batch, loss_fn, loss_normalizer=normalizer)
        if i > 0:
            seconds.append(metrics["time/train_step_s"])
    return sum(seconds) / len(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="tiny shape on CPU (checks the script runs)")
    parser.add_argument("--budget", type=int, default=16384, help="max tokens per micro-batch")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument(
        "--steps", type=int, default=3, help="timed optimizer steps of each kind (after one warm-up)"
    )
    parser.add_argument("--eager", action="store_true", help="no torch.compile of the decoder layers")
    args = parser.parse_args()

    device = torch.device("cpu" if args.tiny else "cuda")
    cfg_model, (min_len, max_len, budget) = (
        (TINY, (16, 128, 256)) if args.tiny else (QWEN3_17B, (256, 4096, args.budget))
    )
    batch = make_batch(min_len, max_len, budget, args.micro_batches, cfg_model["vocab_size"], seed=0)
    cfg = TrainEngineConfig(lr=1e-6, max_tokens_per_micro_batch=budget, compile=not args.eager)
    engine = NativeTrainEngine(cfg, random_model(cfg_model, device), device=device)
    mask = batch.response_mask()
    adv_B = torch.randn(len(batch))

    def rl_loss_fn(logp_bT, entropy_bT, rows):
        adv = adv_B[rows].to(logp_bT.device)[:, None]
        return aggregate_loss_sum(-adv * logp_bT, mask[rows].to(logp_bT.device), MODE), {}

    sft_seconds = timed_steps(
        engine, batch, make_sft_loss_fn(mask, MODE), sft_normalizer(mask, MODE), args.steps
    )
    rl_seconds = timed_steps(engine, batch, rl_loss_fn, loss_normalizer(mask, MODE), args.steps)

    tokens, trained = batch.num_tokens, int(mask.sum())
    flops = step_flops(
        engine.model, [s.num_tokens for s in batch.samples], trained, body_params=engine._body_params
    )
    print(
        f"model {'tiny' if args.tiny else 'Qwen3-1.7B shape'}, {engine.compute_dtype}, compile={not args.eager}, "
        f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}"
    )
    print(
        f"batch: {len(batch)} sequences, {tokens} tokens ({trained} trained), micro-batches of <= {budget} tokens"
    )
    print(f"{'step (fwd+bwd+opt)':<22}{'seconds':>10}{'tokens/s':>12}{'trained/s':>12}{'MFU':>8}")
    for name, secs in (("sft (NLL)", sft_seconds), ("rl (policy gradient)", rl_seconds)):
        mfu = f"{flops / (secs * H100_BF16_PEAK_FLOPS):.1%}" if device.type == "cuda" else "-"
        print(f"{name:<22}{secs:>10.3f}{tokens / secs:>12.0f}{trained / secs:>12.0f}{mfu:>8}")


if __name__ == "__main__":
    main()
