"""Asynchronous RL on a long-tail workload: step time and idle fractions of four layouts (issue 19).

Workload T2: random Qwen3-1.7B weights (28 layers, hidden 2048, 16 heads, 8 KV heads, head dim 128,
vocab 151936), 64 prompts x 8 samples, 128 prompt tokens, response lengths drawn heavy-tailed
between 128 and 4096 (a Pareto draw per prompt; generation stops when the drawn length is reached),
no reference model. Layouts on the same two GPUs:

    sync_colocated  trainer.mode=sync, cluster.placement=colocated, 2 workers (DP2, rollout on both)
    sync_separate   trainer.mode=sync, 1 training GPU + 1 rollout GPU
    one_step_off    trainer.mode=one_step_off, 1 training GPU + 1 rollout GPU
    async_k2        trainer.mode=async, trainer.max_staleness=2, 1 training GPU + 1 rollout GPU

Goal: async >= 1.5x the best synchronous layout's step time. The table reports the median over the
steps after `--warmup`: step time, generation and training seconds, the training group's idle
fraction (1 - its busy stages / step time) and the rollout's (the asynchronous layouts: the rollout
actors' decode time, in every rollout.partial mode; the synchronous ones: 1 - generation / step).

    python benchmarks/bench_async.py                     # 2 GPUs, Ray, all four layouts
    python benchmarks/bench_async.py --layouts async_k2  # some of them
    python benchmarks/bench_async.py --smoke             # CPU, tiny model, one process: the script path

The per-prompt lengths are applied by wrapping the rollout group's `generate` and `stream_add` so
that each request's `max_new_tokens` is its prompt's drawn length.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from bench_e2e import add_shape_args, e2e_config, e2e_context, random_prompts, write_random_qwen3  # noqa: E402

from rlloom.cluster.build import build_groups  # noqa: E402
from rlloom.trainer.async_loop import AsyncLoop  # noqa: E402
from rlloom.trainer.step import rl_step  # noqa: E402

LAYOUTS = {
    "sync_colocated": ["trainer.mode=sync", "cluster.num_workers=2"],
    "sync_separate": ["trainer.mode=sync", "cluster.placement=separate", "cluster.rollout_workers=1"],
    "one_step_off": ["trainer.mode=one_step_off", "cluster.placement=separate", "cluster.rollout_workers=1"],
    "async_k2": [
        "trainer.mode=async",
        "trainer.max_staleness=2",
        "cluster.placement=separate",
        "cluster.rollout_workers=1",
    ],
}


LOOKAHEAD = 3
"""Steps beyond the timed ones that the run is configured for (more than any layout admits ahead)."""


def heavy_tailed_lengths(num: int, low: int, high: int, *, seed: int = 0, alpha: float = 1.2) -> list[int]:
    """`num` lengths in [low, high]: low * Pareto(alpha), capped (most short, a few very long)."""
    rng = random.Random(seed)
    return [min(high, int(low * rng.paretovariate(alpha))) for _ in range(num)]


class LengthCapped:
    """A rollout group whose requests stop at their prompt's drawn length (`limits`: prompt ids ->
    max_new_tokens), through `generate` and through the asynchronous loop's `stream_add`."""

    def __init__(self, group: Any, limits: dict[tuple[int, ...], int]) -> None:
        self.group, self.limits = group, limits

    def _capped(self, prompt_ids: list[int], sampling: Any) -> Any:
        return dataclasses.replace(sampling, max_new_tokens=self.limits[tuple(prompt_ids)])

    def generate(self, prompts: list[list[int]], sampling: list[Any]) -> Any:
        return self.group.generate(prompts, [self._capped(p, s) for p, s in zip(prompts, sampling)])

    def stream_add(self, replica: int, requests: list[Any]) -> None:
        capped = [dataclasses.replace(r, sampling=self._capped(r.prompt_ids, r.sampling)) for r in requests]
        self.group.stream_add(replica, capped)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.group, name)


def run_layout(name: str, args: argparse.Namespace, model_dir: Path, tmp: str) -> list[dict[str, float]]:
    # The run is told of LOOKAHEAD steps more than are timed: the asynchronous layouts admit up to
    # max_staleness + 1 batches ahead, and a run that ends with the timed steps has its producer run
    # dry (its last steps only train, which would flatter them).
    total_steps = args.steps + LOOKAHEAD
    items = random_prompts(args.prompts * (total_steps + 1), args.prompt_tokens, tiny=args.tiny)
    lengths = heavy_tailed_lengths(len(items), args.min_tokens, args.new_tokens)
    limits = {tuple(it.prompt_ids): n for it, n in zip(items, lengths)}
    extra = [
        f"trainer.total_steps={total_steps}",
        "train.gather_once_per_step=false",
        *LAYOUTS[name],
        *args.set,
    ]
    if args.tiny:  # one process: the placements of the layouts are not available, their modes are
        extra = [o for o in extra if not o.startswith("cluster.")]
        extra += ["cluster.device=cpu", "train.compile=false", "rollout.compile=false"]
    else:
        extra += ["cluster.mode=ray"]
    cfg = e2e_config(args, model_dir, Path(tmp) / name, extra)
    groups = build_groups(cfg)
    ctx = dataclasses.replace(
        e2e_context(cfg, groups, args, items),
        rollout_group=LengthCapped(groups.rollout, limits),  # type: ignore[arg-type]
    )
    loop = AsyncLoop(ctx) if cfg.trainer.mode != "sync" else None
    records = []
    try:
        for step in range(args.steps):
            m = rl_step(ctx, step) if loop is None else loop.step(step)
            if step == 0:
                groups.freeze_heap()  # as the run loop does (rlloom/heap.py)
            records.append(m)
            print(
                f"{name} step {step}: {m['time/step_s']:.2f} s (generate {m.get('time/generate_s', 0):.2f}, "
                f"train {m.get('time/train_s', 0):.2f}, sync {m.get('time/sync_s', 0):.2f})",
                flush=True,
            )
    finally:
        groups.close()
    return records


def summary(name: str, records: list[dict[str, float]], warmup: int) -> dict[str, float]:
    steady = records[warmup:] or records
    med = lambda key: statistics.median(r.get(key, float("nan")) for r in steady)  # noqa: E731
    train_busy = [
        sum(r.get(f"time/{k}_s", 0.0) for k in ("old_logprobs", "ref_logprobs", "advantages", "train"))
        for r in steady
    ]
    sync_layout = name.startswith("sync_")  # "async_k2" contains "sync" too
    return {
        "step_s": med("time/step_s"),
        "generate_s": med("time/generate_s"),
        "train_s": med("time/train_s"),
        "train_idle_frac": statistics.median(1 - b / r["time/step_s"] for b, r in zip(train_busy, steady)),
        "rollout_idle_frac": (
            statistics.median(1 - r["time/generate_s"] / r["time/step_s"] for r in steady)
            if sync_layout
            else med("perf/rollout_idle_frac")
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(parser)
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    parser.add_argument("--min-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", dest="new_tokens", type=int, help="the longest response")
    parser.add_argument("--smoke", dest="tiny", action="store_true", help="CPU, tiny model, one process")
    parser.add_argument("--out", default="")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra override")
    parser.set_defaults(new_tokens=4096, kv_gb=60.0)
    args = parser.parse_args()
    if args.tiny:
        args.prompts, args.samples, args.prompt_tokens, args.kv_gb = 2, 2, 8, 0.05
        args.min_tokens, args.new_tokens, args.steps, args.warmup = 4, 32, 3, 1

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_random_qwen3(
            Path(tmp) / "model", tiny=args.tiny, hidden=2048, intermediate=6144, max_positions=8192
        )
        for name in args.layouts:
            results[name] = summary(name, run_layout(name, args, model_dir, tmp), args.warmup)
    best_sync = min((r["step_s"] for n, r in results.items() if n.startswith("sync")), default=float("nan"))
    print("\n| layout | step s | generate s | train s | train idle | rollout idle | speed-up vs best sync |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['step_s']:.2f} | {r['generate_s']:.2f} | {r['train_s']:.2f} | "
            f"{r['train_idle_frac']:.2f} | {r['rollout_idle_frac']:.2f} | {best_sync / r['step_s']:.2f}x |"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
