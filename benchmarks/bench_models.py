"""Forward + backward throughput of the native model against transformers; prints one table.

Default (GPU): a Qwen3-1.7B-shaped model (28 layers, hidden 2048, MLP 6144, 16 heads, 8 KV heads,
head_dim 128, vocab 151936, tied embeddings) with random bf16 weights, batches of 4 x 4096 tokens:
  ours-padded   native model, input [4, 4096], causal SDPA, chunked logprob head (rlloom.models.logprobs)
  ours-packed   native model, the same tokens as one packed stream of 4 sequences (varlen attention)
  ours-varlen   native model, packed stream of random lengths in [256, 4096] with the same total
  hf-sdpa       transformers Qwen3ForCausalLM(attn_implementation="sdpa"), full logits + cross entropy
Each row: tokens/s, step time, MFU against 989 TFLOP/s (H100 SXM dense bf16) and peak memory.

FLOPs per step (model FLOPs, recomputation not counted):
  dense  = 6 * P * N               P = parameters in matmuls (every linear incl. the lm head, not the
                                   embedding lookup), N = tokens in the step; fwd 2PN + bwd 4PN
  attn   = 6 * L * H * d * sum_s T_s^2
                                   per layer and sequence of length T, causal QK^T and PV forward
                                   are 2 * (2 * T^2 * H * d) / 2 = 2 T^2 H d; fwd + bwd is 3x that
  MFU    = (dense + attn) / step_time / 989e12

Usage: python benchmarks/bench_models.py            (GPU, full size)
       python benchmarks/bench_models.py --tiny     (tiny shape, runs on CPU in seconds)
       python benchmarks/bench_models.py --cpu-packed   (CPU packed-attention kernels: masked vs per sequence)
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from rlloom.models import CausalLM, ModelArgs
from rlloom.models.attention_ops import packed_attention
from rlloom.models.logprobs import token_logprobs

PEAK_FLOPS = 989e12
FULL = dict(
    num_hidden_layers=28,
    hidden_size=2048,
    intermediate_size=6144,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    seq_len=4096,
    batch=4,
    min_len=256,
)
TINY = dict(
    num_hidden_layers=2,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=512,
    seq_len=128,
    batch=4,
    min_len=16,
)


def qwen3_config(shape: dict):
    from transformers import Qwen3Config

    keys = (
        "num_hidden_layers",
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
    )
    return Qwen3Config(**{k: shape[k] for k in keys}, tie_word_embeddings=True, max_position_embeddings=40960)


def matmul_params(model: torch.nn.Module) -> int:
    """Parameters that take part in matmuls: all >= 2-D weights (the tied embedding counts once, as lm head)."""
    return sum(p.numel() for p in model.parameters() if p.dim() >= 2)


def step_flops(params: int, shape: dict, lengths: list[int]) -> float:
    dense = 6 * params * sum(lengths)
    attn = (
        6
        * shape["num_hidden_layers"]
        * shape["num_attention_heads"]
        * shape["head_dim"]
        * sum(t * t for t in lengths)
    )
    return dense + attn


def build_ours(cfg, device, dtype) -> CausalLM:
    torch.manual_seed(0)
    with torch.device(device):
        model = CausalLM(ModelArgs.from_hf_config(cfg.to_dict())).to(dtype)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02) if p.dim() >= 2 else torch.nn.init.ones_(p)
    return model


def build_hf(cfg, device, dtype):
    from transformers import Qwen3ForCausalLM

    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return Qwen3ForCausalLM(cfg).to(device=device, dtype=dtype)


def varlen_lengths(total: int, low: int, high: int, seed: int = 0) -> list[int]:
    rng, lengths = random.Random(seed), []
    while sum(lengths) < total:
        lengths.append(min(rng.randint(low, high), total - sum(lengths)))
    return lengths


def ours_step(model: CausalLM, ids, lengths: list[int], packed: bool) -> None:
    if packed:
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=ids.device)
        cu[1:] = torch.tensor(lengths, device=ids.device).cumsum(0)
        pos = torch.cat([torch.arange(n, device=ids.device) for n in lengths])
        hidden = model.hidden_states(ids, position_ids=pos, cu_seqlens=cu, max_seqlen=max(lengths))
    else:
        hidden = model.hidden_states(ids).flatten(0, 1)
    flat = ids.flatten()
    targets = torch.roll(flat, -1)
    logp, _ = token_logprobs(hidden, model.lm_head_weight, targets, chunk_tokens=4096)
    (-logp.mean()).backward()


def hf_step(model, ids, lengths: list[int], packed: bool) -> None:
    logits = model(ids).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), torch.roll(ids.flatten(), -1))
    loss.backward()


def measure(name, step, model, ids, lengths, packed, params, shape, args) -> dict:
    device = ids.device
    for _ in range(args.warmup):
        step(model, ids, lengths, packed)
        model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(args.steps):
        step(model, ids, lengths, packed)
        model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / args.steps
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    flops = step_flops(params, shape, lengths)
    return dict(
        name=name,
        tokens=sum(lengths),
        tok_s=sum(lengths) / seconds,
        ms=seconds * 1e3,
        mfu=100 * flops / seconds / PEAK_FLOPS,
        peak=peak,
    )


def run_models(args) -> None:
    shape = TINY if args.tiny else FULL
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = qwen3_config(shape)
    B, T = shape["batch"], shape["seq_len"]
    gen = torch.Generator().manual_seed(0)
    ids_BT = torch.randint(0, shape["vocab_size"], (B, T), generator=gen).to(device)
    var = varlen_lengths(B * T, shape["min_len"], T)
    rows = []
    ours = build_ours(cfg, device, dtype)
    params = matmul_params(ours)
    rows.append(measure("ours-padded", ours_step, ours, ids_BT, [T] * B, False, params, shape, args))
    rows.append(measure("ours-packed", ours_step, ours, ids_BT.flatten(), [T] * B, True, params, shape, args))
    rows.append(
        measure(
            f"ours-varlen({len(var)} seqs)", ours_step, ours, ids_BT.flatten(), var, True, params, shape, args
        )
    )
    del ours
    if device.type == "cuda":
        torch.cuda.empty_cache()
    hf = build_hf(cfg, device, dtype)
    try:
        rows.append(measure("hf-sdpa", hf_step, hf, ids_BT, [T] * B, False, params, shape, args))
    except torch.OutOfMemoryError:
        peak = torch.cuda.max_memory_allocated() / 2**30
        rows.append(dict(name="hf-sdpa (OOM)", tokens=B * T, tok_s=0.0, ms=float("nan"), mfu=0.0, peak=peak))
    print(
        f"shape: {'tiny' if args.tiny else 'Qwen3-1.7B'}, {B} x {T} tokens, {dtype}, {device}, {params / 1e6:.1f} M matmul params"
    )
    print(f"{'run':<24}{'tokens/s':>12}{'step ms':>10}{'MFU %':>8}{'peak GiB':>10}")
    for r in rows:
        print(f"{r['name']:<24}{r['tok_s']:>12.0f}{r['ms']:>10.1f}{r['mfu']:>8.2f}{r['peak']:>10.2f}")


def masked_packed_attention(q, k, v, scale: float, cu_seqlens) -> torch.Tensor:
    """The alternative CPU kernel: one SDPA over the stream with a block-diagonal causal mask."""
    n = q.shape[0]
    seq_id = torch.repeat_interleave(
        torch.arange(len(cu_seqlens) - 1), (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    )
    mask = (seq_id[:, None] == seq_id[None, :]) & torch.ones(n, n, dtype=torch.bool).tril()
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out.transpose(0, 1)


def run_cpu_packed(args) -> None:
    """Masked single SDPA vs one SDPA per sequence on CPU (SmolLM2 attention: 9 q heads, 3 kv, d 64)."""
    print(f"{'tokens':>8}{'seqs':>6}{'masked ms':>11}{'per-seq ms':>12}   (best of --steps)")
    cases = [
        (96, 8, 32),
        (256, 16, 64),
        (512, 16, 16),
        (512, 32, 256),
        (1024, 32, 256),
        (2048, 32, 256),
        (4096, 32, 256),
    ]
    for total, low, high in cases:
        lengths = varlen_lengths(total, low, high, seed=total)
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(lengths).cumsum(0)
        q, k, v = torch.randn(total, 9, 64), torch.randn(total, 3, 64), torch.randn(total, 3, 64)
        times = []
        for kernel in (masked_packed_attention, packed_attention):
            kernel(q, k, v, 0.125, cu)
            best = float("inf")  # the minimum is robust to other processes sharing the cores
            for _ in range(args.steps):
                start = time.perf_counter()
                kernel(q, k, v, 0.125, cu)
                best = min(best, time.perf_counter() - start)
            times.append(best * 1e3)
        print(f"{total:>8}{len(lengths):>6}{times[0]:>11.2f}{times[1]:>12.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="tiny shape (CPU smoke run)")
    parser.add_argument("--cpu-packed", action="store_true", help="CPU packed-attention kernel comparison")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    run_cpu_packed(args) if args.cpu_packed else run_models(args)


if __name__ == "__main__":
    main()
