"""rollout.match_training on one GPU: the batch-invariant kernels' checks, then the GRPO step in the
default mode and with match_training, in one table.

1. Kernel checks (Qwen3-0.6B shapes, bf16; the experts' grouped product at Qwen3-30B-A3B's
   widths): each batch-invariant kernel against torch's (max relative error) and against itself with
   the same rows in another batch (bitwise yes/no).
2. The GRPO step of bench_e2e.py (random Qwen3-0.6B weights; by default a smaller batch: 32 prompts
   x 8 samples, 128 prompt tokens, 256 new tokens) with the defaults and with
   rollout.match_training=true, each mode in a process of its own (a crash or a time-out costs that
   row only): median step, generate and train seconds over the steps after the first, rollout tok/s,
   and the largest rollout/logp_gap_max (0.0 expected with match_training). With `--moe` the model
   is a MoE of Qwen3-30B-A3B's width with 4 of its 48 layers (bench_moe.py's random weights; with
   --tiny its 2-layer toy).

Every line is printed as soon as it is known, and the table is written to $OUT/bench_exact.md (and
the per-step records to $OUT/bench_exact.json) when OUT is set.

    python benchmarks/bench_exact.py                    # one H200: checks + both modes
    python benchmarks/bench_exact.py --prompts 64 --new-tokens 512   # bench_e2e's T1 shape
    python benchmarks/bench_exact.py --tiny --steps 2   # a small smoke run
    python benchmarks/bench_exact.py --moe --skip-checks   # the MoE model in both modes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bounded import run_bounded  # noqa: E402  (beside this file)

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


def check_grouped_matmul() -> tuple[bool, float]:
    """The experts' gate/up product at Qwen3-30B-A3B's widths: a token's row alone in its expert."""
    from rlloom.models.exact_kernels import grouped_matmul

    experts = 128
    offsets = (torch.arange(experts, device="cuda") % 41).cumsum(0).to(torch.int32)
    x, w = _randn(int(offsets[-1]), 2048, seed=10), _randn(experts, 768, 2048, seed=11, scale=0.03)
    full = grouped_matmul(x, w, offsets)
    row = int(offsets[39]) + 17  # in expert 40
    alone = grouped_matmul(x[row : row + 1], w, (torch.arange(experts, device="cuda") >= 40).to(torch.int32))
    return torch.equal(alone[0], full[row]), _rel(
        full, torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)
    )


def check_rms_norm() -> tuple[bool, float]:
    """The fused RMSNorm (models/exact_fused.py) at hidden 1024: a row alone."""
    from rlloom.models.exact_fused import rms_norm

    x, w = _randn(4096, 1024, seed=12, scale=3.0), _randn(1024, seed=13)
    full = rms_norm(x, w, 1e-6)
    ref = w * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
    return torch.equal(rms_norm(x[100:101], w, 1e-6), full[100:101]), _rel(full, ref)


def check_swiglu_rope() -> tuple[bool, float]:
    """The fused silu(gate) * up on the rollout's fused gate/up halves = on separate tensors, and
    rope on 16 heads of 128: a row alone."""
    from rlloom.models.exact_fused import rope, silu_mul
    from rlloom.models.layers import _rotate_half

    gate, up = _randn(2048, 2 * 3072, seed=14).split(3072, dim=-1)
    mlp = silu_mul(gate, up)
    same = torch.equal(silu_mul(gate.contiguous(), up.contiguous()), mlp)
    q, angles = _randn(2048, 16, 128, seed=15), torch.rand(2048, 64, device="cuda") * 100
    cos, sin = (f(torch.cat([angles, angles], -1)).to(torch.bfloat16) for f in (torch.cos, torch.sin))
    rot = rope(q, cos, sin, False)
    same = same and torch.equal(rope(q[9:10], cos[9:10], sin[9:10], False), rot[9:10])
    ref = q * cos[:, None] + _rotate_half(q) * sin[:, None]
    return same, max(_rel(mlp, torch.nn.functional.silu(gate) * up), _rel(rot, ref))


def kernel_checks() -> None:
    checks: dict[str, Callable[[], tuple[bool, float]]] = {
        "matmul (rows 1/1/297 of 512; fused = separate)": check_matmul,
        "lm head + log-sum-exp (row 1 of 256, V=151936)": check_lm_head,
        "row sum (row 1 of 4096)": check_row_sum,
        "fused RMSNorm (row 1 of 4096)": check_rms_norm,
        "fused silu*up (fused halves = separate) and rope (row 1)": check_swiglu_rope,
        "MoE grouped product (a row alone in its expert)": check_grouped_matmul,
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


def run_mode(args: argparse.Namespace) -> None:
    """One mode's steps in this process; prints one JSON line with the per-step records."""
    from bench_e2e import e2e_config, e2e_context, tiny_shape, write_random_qwen3

    from rlloom.cluster.build import build_groups
    from rlloom.trainer.step import rl_step

    if args.tiny:
        tiny_shape(args)
    extra = ["rollout.match_training=true"] if args.mode == "match_training" else []
    with tempfile.TemporaryDirectory() as tmp:
        if args.moe:
            from bench_moe import QWEN3_30B_A3B_8L, TINY, write_random_checkpoint

            config = TINY if args.tiny else QWEN3_30B_A3B_8L | {"num_hidden_layers": 4}
            model_dir = write_random_checkpoint(Path(tmp) / "model", config)
        else:
            model_dir = write_random_qwen3(Path(tmp) / "model", tiny=args.tiny)
        cfg = e2e_config(args, model_dir, Path(tmp) / "run", extra)
        groups = build_groups(cfg)
        ctx = e2e_context(cfg, groups, args)
        records = []
        for step in range(args.steps):
            m = rl_step(ctx, step)
            keep = {k: v for k, v in m.items() if k.startswith(("time/", "rollout/logp_gap_max"))}
            records.append(keep)
            print(f"{args.mode} step {step}: {json.dumps(keep)}", file=sys.stderr, flush=True)
        groups.close()
    print("RECORDS " + json.dumps(records), flush=True)


def mode_row(args: argparse.Namespace, mode: str) -> dict | None:
    """Run `mode` in a child process; emit its row; return its summary (None if it failed)."""
    cmd = [sys.executable, __file__, "--mode", mode, "--steps", str(args.steps)]
    cmd += ["--prompts", str(args.prompts), "--samples", str(args.samples)]
    cmd += ["--prompt-tokens", str(args.prompt_tokens), "--new-tokens", str(args.new_tokens)]
    cmd += ["--kv-gb", str(args.kv_gb)] + (["--tiny"] if args.tiny else []) + (["--moe"] if args.moe else [])
    start = time.time()
    proc = run_bounded(cmd, args.mode_timeout_s, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if proc is None:  # its process tree was killed
        emit(f"| {mode} | timed out after {args.mode_timeout_s} s | | | | |")
        return None
    found = [line for line in proc.stdout.splitlines() if line.startswith("RECORDS ")]
    if proc.returncode != 0 or not found:
        tail = " / ".join(proc.stderr.strip().splitlines()[-3:])[:300]
        emit(f"| {mode} | failed (exit {proc.returncode}): {tail} | | | | |")
        return None
    records = json.loads(found[0][len("RECORDS ") :])
    steady = records[1:] or records
    med = {
        k: statistics.median(r[k] for r in steady) for k in ("time/step_s", "time/generate_s", "time/train_s")
    }
    gap = max(r.get("rollout/logp_gap_max", float("nan")) for r in records)
    tok_s = args.prompts * args.samples * args.new_tokens / med["time/generate_s"]
    emit(
        f"| {mode} | {med['time/step_s']:.3f} | {med['time/generate_s']:.3f} | {med['time/train_s']:.3f} "
        f"| {tok_s:.0f} | {gap:.3g} |"
    )
    print(f"({mode}: {time.time() - start:.0f} s in its process)", flush=True)
    return {"mode": mode, "records": records, **med, "tok_s": tok_s, "gap": gap}


def main() -> None:
    from bench_e2e import add_shape_args, tiny_shape

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(parser)
    parser.set_defaults(prompts=32, new_tokens=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--mode", choices=["default", "match_training"], help=argparse.SUPPRESS)
    parser.add_argument("--mode-timeout-s", type=int, default=270)
    parser.add_argument("--skip-checks", action="store_true")
    parser.add_argument("--moe", action="store_true", help="a MoE model (Qwen3-30B-A3B's width, 4 layers)")
    args = parser.parse_args()
    if args.mode:
        return run_mode(args)
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
    emit("")
    emit(
        f"| mode ({'MoE, ' if args.moe else ''}{args.prompts} prompts x {args.samples}, {args.new_tokens} new tokens; median of steps 2..{args.steps}) "
        "| step s | generate s | train s | rollout tok/s | max logp_gap_max |"
    )
    emit("|---|---|---|---|---|---|")
    rows = [mode_row(args, mode) for mode in ("default", "match_training")]
    if all(rows):
        base, exact = rows
        emit("")
        emit(f"match_training / default: step {exact['time/step_s'] / base['time/step_s']:.2f}x, "
             f"rollout tok/s {exact['tok_s'] / base['tok_s']:.2f}x")  # fmt: skip
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_exact.md").write_text("\n".join(LINES) + "\n")
        (out / "bench_exact.json").write_text(json.dumps([r for r in rows if r]))


if __name__ == "__main__":
    main()
