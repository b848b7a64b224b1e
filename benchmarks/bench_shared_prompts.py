"""Shared-prompt packing: one training step with `share_prompts` on versus off (one table).

The GRPO demo workload on CPU: SmolLM2-135M-Instruct (embedded in rlloom), 8 groups of 4 samples,
prompts of 46 tokens shared within a group, responses of uniform 5..32 tokens (fixed seed), token
budget 2048, token-mean policy loss, fp32. Each setting gets one warm-up step, then the median of
3 timed `train_step`s. Columns: tokens the model computes per step, micro-batches, seconds.

    python benchmarks/bench_shared_prompts.py
    python benchmarks/bench_shared_prompts.py --random-weights --device cuda   # SmolLM2's shape, bf16
    python benchmarks/bench_shared_prompts.py --attention   # instead: the tree attention kernels

`--random-weights` builds SmolLM2-135M's architecture with random weights (same FLOPs, no cached
checkpoint needed); on CUDA the engine computes in bf16 (FSDP2 on one GPU).

`--attention` times forward + backward of one tree segment (prompt 50 + 4 branches of 20, SmolLM2
attention shapes) with the two exact CPU kernels: one SDPA with an [L, L] mask (what
`attention_ops.tree_attention` does), and causal SDPA over the prompt plus one masked SDPA per branch
over cat(prompt k/v, branch k/v).
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import time

import torch
import torch.nn.functional as F

from rlloom.algorithms.losses import aggregate_loss_sum, loss_normalizer
from rlloom.config import TrainEngineConfig
from rlloom.data.types import RolloutBatch, Sample
from rlloom.engines.train.native import NativeTrainEngine
from rlloom.models import attention_ops, from_pretrained
from rlloom.models.checkpoint import build_model

MODE = "token-mean"
SMOLLM2_135M = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "attention_bias": False,
}


def load_model(random_weights: bool) -> torch.nn.Module:
    if not random_weights:
        return from_pretrained("smollm2-135m-instruct", dtype=torch.float32, device="cpu")
    model = build_model(SMOLLM2_135M, dtype=torch.float32, device="cpu")
    model.init_buffers()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones(p.shape) if "norm" in name else torch.randn(p.shape, generator=gen) * 0.02)
    return model


def make_batch(groups: int, n: int, prompt_len: int, vocab: int, seed: int = 0) -> RolloutBatch:
    rng = random.Random(seed)
    samples = []
    for g in range(groups):
        prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        for _ in range(n):
            response = [rng.randrange(vocab) for _ in range(rng.randint(5, 32))]
            samples.append(Sample(prompt_ids=prompt, response_ids=response, group_id=g))
    return RolloutBatch(samples)


def policy_loss(batch: RolloutBatch):
    adv_B = torch.randn(len(batch), generator=torch.Generator().manual_seed(0))
    mask_BT = batch.response_mask()

    def loss_fn(logp_bT, entropy_bT, rows):
        adv_bT, mask_bT = adv_B[rows, None].to(logp_bT.device), mask_BT[rows].to(logp_bT.device)
        return aggregate_loss_sum(-adv_bT * logp_bT, mask_bT, MODE), {}

    return loss_fn, loss_normalizer(mask_BT, MODE)


def time_steps(engine: NativeTrainEngine, batch: RolloutBatch, repeats: int) -> tuple[float, dict]:
    loss_fn, normalizer = policy_loss(batch)
    engine.train_step(batch, loss_fn, loss_normalizer=normalizer)  # warm-up
    seconds, metrics = [], {}
    for _ in range(repeats):
        start = time.perf_counter()
        metrics = engine.train_step(batch, loss_fn, loss_normalizer=normalizer)  # synchronises CUDA
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), metrics


def bench_train(args: argparse.Namespace) -> None:
    model = load_model(args.random_weights)
    batch = make_batch(args.groups, args.n, args.prompt_len, model.args.vocab_size)
    rows = []
    for share in (False, True):
        cfg = TrainEngineConfig(max_tokens_per_micro_batch=args.budget, share_prompts=share)
        engine = NativeTrainEngine(cfg, copy.deepcopy(model), device=args.device)
        seconds, m = time_steps(engine, batch, args.repeats)
        rows.append((share, int(m["train/tokens"]), int(m["train/computed_tokens"]), m, seconds))
    print(
        f"# {args.groups} groups x {args.n}, prompt {args.prompt_len}, responses 5..32, budget "
        f"{args.budget}, {args.device} ({torch.get_num_threads()} threads), "
        f"{'random' if args.random_weights else 'SmolLM2'} weights, median of {args.repeats} train_step"
    )
    print(
        f"{'share_prompts':>13} {'sample tok':>10} {'computed tok':>12} {'micro-batches':>13} {'step s':>8}"
    )
    for share, tokens, computed, m, seconds in rows:
        print(
            f"{str(share):>13} {tokens:>10} {computed:>12} {int(m['train/num_micro_batches']):>13} {seconds:>8.2f}"
        )
    print(
        f"speed-up (off / on): {rows[0][4] / rows[1][4]:.2f}x; computed tokens {rows[1][2] / rows[0][2]:.2f}x"
    )


def _per_branch(q, k, v, prefix_len, branch_lens, scale):
    """Causal SDPA over the prompt, then one SDPA per branch over cat(prompt k/v, branch k/v)."""
    q, k, v = (x.transpose(0, 1) for x in (q, k, v))
    p = prefix_len
    outs = [
        F.scaled_dot_product_attention(
            q[:, :p], k[:, :p], v[:, :p], is_causal=True, scale=scale, enable_gqa=True
        )
    ]
    start = p
    for r in branch_lens:
        kk, vv = (torch.cat([x[:, :p], x[:, start : start + r]], 1) for x in (k, v))
        mask = torch.ones(r, p + r, dtype=torch.bool)
        mask[:, p:] = torch.ones(r, r, dtype=torch.bool).tril()
        outs.append(
            F.scaled_dot_product_attention(
                q[:, start : start + r], kk, vv, attn_mask=mask, scale=scale, enable_gqa=True
            )
        )
        start += r
    return torch.cat(outs, 1).transpose(0, 1)


def bench_attention(args: argparse.Namespace) -> None:
    prefix_len, branch_lens, heads, kv_heads, dim, scale = 50, [20] * 4, 9, 3, 64, 64**-0.5
    n = prefix_len + sum(branch_lens)
    cu = torch.tensor([0, n], dtype=torch.int32)
    tree = attention_ops.TreePlan(cu, torch.tensor([prefix_len]), torch.tensor(branch_lens))
    kernels = {
        "one masked SDPA": lambda q, k, v: attention_ops.tree_attention(q, k, v, scale, tree),
        "prompt + per branch": lambda q, k, v: _per_branch(q, k, v, prefix_len, branch_lens, scale),
    }
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(n, h, dim, generator=gen).requires_grad_() for h in (heads, kv_heads, kv_heads)]
    outs, times = {}, {name: [] for name in kernels}
    for _ in range(args.repeats):
        for name, fn in kernels.items():  # interleaved, so load from other processes hits both alike
            for _ in range(5):  # warm-up
                fn(*inputs).sum().backward()
            start = time.perf_counter()
            for _ in range(50):
                out = fn(*inputs)
                out.sum().backward()
            times[name].append((time.perf_counter() - start) / 50 * 1e3)
            outs[name] = out.detach()
    diff = (outs["one masked SDPA"] - outs["prompt + per branch"]).abs().max().item()
    print(
        f"# tree segment prompt {prefix_len} + branches {branch_lens}, fwd+bwd, {torch.get_num_threads()} threads"
    )
    print(f"{'kernel':>20} {'ms (median)':>12}")
    for name, ts in times.items():
        print(f"{name:>20} {statistics.median(ts):>12.3f}")
    print(f"max |difference| {diff:.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--n", type=int, default=4, help="samples per group")
    parser.add_argument("--prompt-len", type=int, default=46)
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--random-weights", action="store_true", help="SmolLM2's shape with random weights")
    parser.add_argument("--attention", action="store_true", help="time the tree attention kernels instead")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    bench_attention(args) if args.attention else bench_train(args)


if __name__ == "__main__":
    main()
