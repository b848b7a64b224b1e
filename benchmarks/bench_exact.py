"""rollout.match_training on one GPU: the batch-invariant kernels' checks, then the GRPO step in the
default mode and with match_training, in one table.

1. Kernel checks (Qwen3-0.6B shapes, bf16): each batch-invariant kernel against torch's (max
   relative error) and against itself with the same rows in another batch (bitwise yes/no).
2. The GRPO step of bench_e2e.py (random Qwen3-0.6B weights; by default a smaller batch: 32 prompts
   x 8 samples, 128 prompt tokens, 256 new tokens) with the defaults and with
   rollout.match_training=true: bench_e2e.py's `--modes` table (each mode in a process of its own,
   a crash or a time-out costs that row only; the largest rollout/logp_gap_max is 0.0 expected with
   match_training).

Every line is printed as soon as it is known, and the table is written to $OUT/bench_exact.md (and
the per-step records to $OUT/bench_exact.json) when OUT is set.

    python benchmarks/bench_exact.py                    # one H200: checks + both modes
    python benchmarks/bench_exact.py --prompts 64 --new-tokens 512   # bench_e2e's T1 shape
    python benchmarks/bench_exact.py --tiny --steps 2   # a small smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

LINES: list[str] = []


def emit(line: str) -> None:
    """Print a line of the report now and keep it for $OUT."""
    print(line, flush=True)
    LINES.append(line)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-30)).item()


def _randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)


def check_matmul() -> tuple[bool, float]:
    from rlloom.models.exact_kernels import matmul

    a, w = _randn(512, 1024, seed=0), _randn(3072, 1024, seed=1, scale=0.03)
    full = matmul(a, w.t())
    same = all(torch.equal(matmul(a[s], w.t()), full[s]) for s in (slice(0, 1), slice(9, 10), slice(3, 300)))
    fused = matmul(a, torch.cat([w, w[:1024]]).t())
    same = same and torch.equal(fused[:, :3072], full)
    return same, _rel(full, a @ w.t())


def check_lm_head() -> tuple[bool, float]:
    from rlloom.models.exact_kernels import matmul, row_logsumexp

    h, w = _randn(256, 1024, seed=2), _randn(151936, 1024, seed=3, scale=0.03)
    logits = matmul(h, w.t()).float()
    lse = row_logsumexp(logits)
    same = torch.equal(row_logsumexp(matmul(h[7:8], w.t()).float()), lse[7:8])
    return same, _rel(lse, logits.logsumexp(-1))


def check_row_sum() -> tuple[bool, float]:
    from rlloom.models.exact_kernels import row_sum

    x = _randn(4096, 1024, seed=4).float().pow(2)
    full = row_sum(x)
    return torch.equal(row_sum(x[100:101]), full[100:101]), _rel(full, x.sum(-1))


def _qkv(n: int, seed: int) -> tuple[torch.Tensor, ...]:
    return _randn(n, 16, 128, seed=seed), _randn(n, 8, 128, seed=seed + 1), _randn(n, 8, 128, seed=seed + 2)


def check_attention_packed() -> tuple[bool, float]:
    from rlloom.models.attention_ops import packed_attention
    from rlloom.models.exact_attention import attend_runs, packed_runs

    lens = [640, 1, 77, 1024]
    q, k, v = _qkv(sum(lens), seed=5)
    cu = torch.tensor([0, *lens], device="cuda").cumsum(0).to(torch.int32)
    out = attend_runs(q, k, v, 0.088, packed_runs(cu, max(lens), q.shape[0]))
    s = slice(641, 718)
    alone = attend_runs(q[s], k[s], v[s], 0.088, packed_runs(cu.new_tensor([0, 77]), 77, 77))
    return torch.equal(alone, out[s]), _rel(out, packed_attention(q, k, v, 0.088, cu, max(lens)))


def check_attention_paged() -> tuple[bool, float]:
    """Decode steps and prefill chunks through a block table equal the packed forward's rows."""
    from rlloom.models.exact_attention import Runs, attend_runs, packed_runs

    length, bs = 600, 16
    q, k, v = _qkv(length, seed=8)
    packed = attend_runs(
        q, k, v, 0.088, packed_runs(torch.tensor([0, length], device="cuda"), length, length)
    )
    slots = (torch.randperm(64, device="cuda")[:38, None] * bs + torch.arange(bs, device="cuda")).flatten()
    k_cache = torch.zeros(64 * bs, 8, 128, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    k_cache[slots[:length]], v_cache[slots[:length]] = k, v
    same = True
    for first, n in ((599, 1), (300, 1), (0, 600), (100, 250)):
        one = torch.tensor([0], device="cuda")
        runs = Runs(one, one + n, one, one + first + n, slots, n)
        same = same and torch.equal(
            attend_runs(q[first : first + n], k_cache, v_cache, 0.088, runs), packed[first : first + n]
        )
    return same, 0.0


def kernel_checks() -> None:
    checks: dict[str, Callable[[], tuple[bool, float]]] = {
        "matmul (rows 1/1/297 of 512; fused = separate)": check_matmul,
        "lm head + log-sum-exp (row 1 of 256, V=151936)": check_lm_head,
        "row sum (row 1 of 4096)": check_row_sum,
        "attention packed (a sequence alone)": check_attention_packed,
        "attention paged decode/prefill = packed": check_attention_paged,
    }
    emit("| kernel check | bitwise batch-invariant | max rel. error vs torch |")
    emit("|---|---|---|")
    for name, check in checks.items():
        try:
            same, err = check()
            emit(f"| {name} | {'yes' if same else 'NO'} | {err:.2e} |")
        except Exception as e:  # noqa: BLE001 (a report, not a test: show it and go on)
            emit(f"| {name} | error: {type(e).__name__}: {str(e).splitlines()[0][:120]} | |")


def main() -> None:
    from bench_e2e import add_shape_args, run_modes, tiny_shape

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(parser)
    parser.set_defaults(prompts=32, new_tokens=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--mode-timeout-s", type=int, default=270)
    parser.add_argument("--skip-checks", action="store_true")
    args = parser.parse_args()
    if args.tiny:
        tiny_shape(args)
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    emit(
        f"device: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA'}; torch {torch.__version__}"
    )
    if not args.skip_checks:
        try:
            kernel_checks()
        except Exception:  # noqa: BLE001
            emit("kernel checks failed: " + traceback.format_exc().splitlines()[-1])
    args.modes = ["default", "match_training"]
    shape = ["--steps", args.steps, "--prompts", args.prompts, "--samples", args.samples]
    shape += ["--prompt-tokens", args.prompt_tokens, "--new-tokens", args.new_tokens, "--kv-gb", args.kv_gb]
    records = run_modes(args, [str(a) for a in shape] + (["--tiny"] if args.tiny else []), emit)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_exact.md").write_text("\n".join(LINES) + "\n")
        (out / "bench_exact.json").write_text(json.dumps(records))


if __name__ == "__main__":
    main()
