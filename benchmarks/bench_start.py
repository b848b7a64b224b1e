"""Fast start (issue 17): the time to the first generated token and the first step, cold and warm cache.

Runs an RL workload twice, each in a fresh process, with one compile cache directory
(`RLLOOM_COMPILE_CACHE`, rlloom/compile_cache.py) that starts empty: run 1 compiles everything (cold),
run 2 finds Inductor's, AOTAutograd's, the autotuner's and Triton's entries on disk (warm). Dynamo's
tracing and the CUDA-graph capture run in both. Per run, in seconds: imports (process start to the
benchmark's first line), model build (training and rollout engines), first generated token (from
process start), first step (the warm-up step, compilation included), the median of the later (steady)
steps, and the whole process; then the cache's size after the run. Workloads:
  - dense (default): the bench_e2e workload (T1: random Qwen3-0.6B weights, 64 prompts x 8 samples,
    128 prompt tokens, 512 new tokens; see bench_e2e.py);
  - `--moe`: random bf16 weights of Qwen3-30B-A3B's width with 8 of its 48 layers (bench_moe's
    QWEN3_30B_A3B_8L: 128 experts, 8 per token; 5.6B parameters, an 11 GB checkpoint written by
    bench_moe.write_random_checkpoint without initialising a model, before and outside the timed runs),
    32 prompts x 8 samples, 128 prompt tokens, 256 new tokens, an 8 GB KV cache, micro-batches of
    <= 16384 tokens not gathered once (a step's 98,304 tokens in 6 or more): sized for one H200 (fp32
    master weights, gradients and AdamW of 5.6B parameters: about 90 GB; bf16 rollout weights: 11 GB).
Both use the bench_e2e run config (e2e_config) and its parity reward; only the checkpoint and the
sizes differ.

    python benchmarks/bench_start.py                # one GPU: both runs (expected 3-4 minutes)
    python benchmarks/bench_start.py --moe          # the MoE job on one H200 (not an 80 GB GPU)
    python benchmarks/bench_start.py --tiny         # CPU smoke run of the script (CPU runs do not compile)
    python benchmarks/bench_start.py --moe --tiny   # the same with a tiny Qwen3-MoE (8 experts, 2 per token)
    python benchmarks/bench_start.py --cache DIR    # keep the cache in DIR (new or empty) to inspect it
    python benchmarks/bench_start.py --profile DIR  # and a third, warm run of one step under cProfile:
                                                    # DIR/warm.pstats, its top functions printed

Every run also prints torch's own compile-time breakdown (Dynamo tracing, the backend compiler) and
rlloom's INFO log lines (each decode graph's capture time) to its stderr. The runs share a Python
bytecode cache (PYTHONPYCACHEPREFIX in the cache directory, PYTHONDONTWRITEBYTECODE dropped): an
installed package has its bytecode compiled, but an environment without it (as on the benchmark
machine) would otherwise compile torch's lazily imported sources again in every process (about 8 s).
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_e2e import add_shape_args, e2e_config, e2e_context, tiny_shape, write_random_qwen3  # noqa: E402

from rlloom.observability.startup import first_token_s, seconds_since_process_start  # noqa: E402

ROOT = Path(__file__).parents[1]
MARK = "bench_start: "  # the child's result line on stdout
# --moe: the workload's sizes (defaults of the shape options; --tiny still shrinks them) and settings.
MOE_SHAPE = dict(prompts=32, samples=8, prompt_tokens=128, new_tokens=256, kv_gb=8.0)
MOE_SETTINGS = ["train.max_tokens_per_micro_batch=16384", "train.gather_once_per_step=false"]


def child(args: argparse.Namespace) -> None:
    """One run in this (fresh) process: build, then `args.steps` GRPO steps; prints one JSON line."""
    imports_s = seconds_since_process_start()
    import logging

    import torch._dynamo.utils

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
    logging.getLogger("rlloom").addHandler(handler)
    logging.getLogger("rlloom").setLevel(logging.INFO)

    from rlloom.cluster.build import build_groups
    from rlloom.trainer.step import rl_step

    with tempfile.TemporaryDirectory() as tmp:
        settings = (MOE_SETTINGS if args.moe else []) + args.set
        cfg = e2e_config(args, Path(args.model), Path(tmp) / "run", settings)
        start = time.perf_counter()
        groups = build_groups(cfg)
        build_s = time.perf_counter() - start
        ctx = e2e_context(cfg, groups, args)
        steps = []
        for step in range(args.steps):
            metrics = rl_step(ctx, step)
            if step == 0:
                groups.freeze_heap()  # as the run loop does (rlloom/heap.py)
            steps.append(metrics["time/step_s"])
            times = ", ".join(
                f"{k.removeprefix('time/')} {v:.1f}" for k, v in metrics.items() if k.startswith("time/")
            )
            print(
                f"bench_start: step {step} at {seconds_since_process_start():.1f} s: {times}",
                file=sys.stderr,
                flush=True,
            )
        groups.close()
    print(torch._dynamo.utils.compile_times(repr="str", aggregate=True), file=sys.stderr, flush=True)
    result = {
        "imports_s": imports_s,
        "build_s": build_s,
        "first_token_s": first_token_s(),
        "first_step_s": steps[0],
        "steady_step_s": statistics.median(steps[1:]) if len(steps) > 1 else float("nan"),
        "process_s": seconds_since_process_start(),
    }
    print(MARK + json.dumps(result), flush=True)


def run_once(
    args: argparse.Namespace, model_dir: Path, cache: Path, profile: Path | None = None
) -> dict[str, float]:
    """One child process with the cache at `cache` (the user's TORCHINDUCTOR_, TRITON_ and
    PYTHONDONTWRITEBYTECODE settings dropped); with `profile`, one step under cProfile, its
    statistics written to that file."""
    dropped = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "PYTHONDONTWRITEBYTECODE")
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    env.update(
        RLLOOM_COMPILE_CACHE=str(cache),
        PYTHONPYCACHEPREFIX=str(cache / "pycache"),
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
    )
    argv = [sys.executable, __file__, *sys.argv[1:], "--child-model", str(model_dir)]
    if profile is not None:
        argv[1:1] = ["-m", "cProfile", "-o", str(profile)]
        argv += ["--steps", "1"]
    try:
        out = subprocess.run(argv, env=env, stdout=subprocess.PIPE, text=True, timeout=args.timeout_s)
    except subprocess.TimeoutExpired:
        sys.exit(
            f"bench_start: a run took longer than --timeout-s={args.timeout_s:g}; raise it or use fewer --steps"
        )
    lines = [x for x in out.stdout.splitlines() if x.startswith(MARK)]
    if out.returncode != 0 or not lines:
        sys.exit(f"bench_start: a run failed (exit {out.returncode}); its output is above")
    result = json.loads(lines[-1].removeprefix(MARK))
    files = [f for f in cache.rglob("*") if f.is_file() and "pycache" not in f.relative_to(cache).parts]
    result["cache_mb"] = sum(f.stat().st_size for f in files) / 2**20
    result["cache_files"] = len(files)
    return result


def print_table(runs: list[tuple[str, dict[str, float]]], args: argparse.Namespace) -> None:
    model = {(False, False): "Qwen3-0.6B", (False, True): "tiny", (True, False): "Qwen3-30B-A3B width, 8 layers",
             (True, True): "tiny Qwen3-MoE"}[args.moe, args.tiny]  # fmt: skip
    shape = f"{args.prompts} prompts x {args.samples}, {args.prompt_tokens}+{args.new_tokens} tokens"
    print(f"\n| run ({model}, {shape}) | imports s | model build s | "
          "first token s (from process start) | first step s (warm-up) | steady step s | process s | "
          "cache MB (files) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for name, r in runs:
        token = "n/a" if r["first_token_s"] is None else f"{r['first_token_s']:.1f}"
        print(
            f"| {name} | {r['imports_s']:.1f} | {r['build_s']:.1f} | {token} | {r['first_step_s']:.1f} | "
            f"{r['steady_step_s']:.2f} | {r['process_s']:.1f} | {r['cache_mb']:.1f} ({r['cache_files']}) |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="steps per run (the first is the warm-up)")
    add_shape_args(parser)
    parser.add_argument(
        "--cache", default="", help="cache directory, new or empty (default: a temporary one)"
    )
    parser.add_argument("--timeout-s", type=float, default=280.0, help="limit per run")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="extra config override"
    )
    parser.add_argument(
        "--profile", default="", metavar="DIR", help="add a warm run of one step under cProfile, saved in DIR"
    )
    parser.add_argument(
        "--moe", action="store_true", help="the MoE job (Qwen3-30B-A3B's width, 8 layers; see above)"
    )
    parser.add_argument("--child-model", default="", help=argparse.SUPPRESS)
    if parser.parse_known_args()[0].moe:
        parser.set_defaults(**MOE_SHAPE)
    args = parser.parse_args()
    if args.tiny:
        tiny_shape(args)
    if args.child_model:
        args.model = args.child_model
        child(args)
        return
    if args.cache and Path(args.cache).exists() and any(Path(args.cache).iterdir()):
        sys.exit(
            f"bench_start: --cache {args.cache} is not empty; run 1 must start cold. Fix: name a new directory."
        )
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model(Path(tmp) / "model", args)
        cache = Path(args.cache) if args.cache else Path(tmp) / "compile-cache"
        cache.mkdir(parents=True, exist_ok=True)
        runs = []
        for name in ("1 cold", "2 warm"):
            runs.append((name, run_once(args, model_dir, cache)))
            print(f"run {name}: {json.dumps(runs[-1][1])}", flush=True)
        if args.profile:
            stats = Path(args.profile) / "warm.pstats"
            stats.parent.mkdir(parents=True, exist_ok=True)
            runs.append(("3 warm, cProfile (1 step)", run_once(args, model_dir, cache, stats)))
            print_profile(stats)
    print_table(runs, args)


def write_model(path: Path, args: argparse.Namespace) -> Path:
    """The run's random checkpoint: dense Qwen3 (bench_e2e) or, with --moe, Qwen3-MoE (bench_moe)."""
    if not args.moe:
        return write_random_qwen3(path, tiny=args.tiny)
    from bench_moe import QWEN3_30B_A3B_8L, TINY, write_random_checkpoint

    return write_random_checkpoint(path, TINY if args.tiny else QWEN3_30B_A3B_8L)


def print_profile(stats: Path, top: int = 40) -> None:
    """The profiled run's functions with the most cumulative and the most own time."""
    import pstats

    for key in ("cumulative", "tottime"):
        print(f"\n--- cProfile of the warm run, by {key} ---", flush=True)
        pstats.Stats(str(stats)).sort_stats(key).print_stats(top)


if __name__ == "__main__":
    main()
