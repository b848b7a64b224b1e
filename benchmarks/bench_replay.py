"""Rollout routing replay (issue 17): how far training's experts and logprobs are from the rollout's,
with and without `algorithm.routing_replay=rollout`, in one table.

The MoE RL job of `bench_start.py --moe` (random bf16 weights of Qwen3-30B-A3B's width with 8 of its
48 layers, 32 prompts x 8 samples, 128 prompt tokens, 256 new tokens, the parity reward, lr 1e-6),
run for `--steps` GRPO steps once per setting, each setting in a fresh process (an engine's compiled
graphs and CUDA graphs keep its GPU memory for the life of the process). Per setting, the mean
over the steps of:
  - moe/route_mismatch_frac: the fraction of (token, MoE layer) pairs whose experts, as the training
    router chooses them in the old-logprob pass, differ from the ones the rollout used (reported
    with and without replay: with it, training uses the rollout's experts anyway);
  - rollout/logp_gap_abs: mean |logp_train - logp_rollout| over response tokens;
  - rollout/token_mult_prob_error: NeMo-RL's mean exp|logp_train - logp_rollout| (1 = equal);
  - rollout/logp_gap_max: the largest |logp_train - logp_rollout| over the steps' response tokens;
  - the step time and its generate and weight-sync parts (the first step, which compiles, is left out of the mean).
With `--fp8`, the same two settings again with `rollout.quantization=fp8` (the rollout's routed
experts in fp8, training unchanged): what fp8 adds to the mismatch, and what it saves of the step.
With `--modes` (issue 42), the settings once per mode of bench_e2e.py's MODES: `default`,
`deterministic` (trainer.deterministic=true) and `match_training` (rollout.match_training=true: no
replay and no fp8 rows, its routes are the rollout's by construction). A setting that fails (for
example a mode the model's family does not support on this device) gets a row that says so.

    python benchmarks/bench_replay.py                 # one H200 (fp32 master weights of 5.6B parameters)
    python benchmarks/bench_replay.py --fp8           # also the rows with fp8 experts in the rollout
    python benchmarks/bench_replay.py --modes default,deterministic,match_training
    python benchmarks/bench_replay.py --tiny          # the code path with a tiny Qwen3-MoE on CPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_e2e import MODES, add_shape_args, e2e_config, e2e_context, parse_modes, tiny_shape  # noqa: E402
from bench_start import MOE_SETTINGS, MOE_SHAPE, write_model  # noqa: E402

from rlloom.cluster.build import build_groups  # noqa: E402
from rlloom.trainer.step import rl_step  # noqa: E402

METRICS = ("moe/route_mismatch_frac", "rollout/logp_gap_abs", "rollout/token_mult_prob_error")
"""Means over the steps (the route mismatch is absent under match_training: no old-logprob pass)."""
MARK = "bench_replay: "  # the child's result line on stdout
ROOT = Path(__file__).parents[1]


def run(args: argparse.Namespace, model_dir: Path, replay: str, quantization: str) -> dict[str, float]:
    """`args.steps` steps in mode `args.mode` with `algorithm.routing_replay=replay` and
    `rollout.quantization`; the metrics' means over the steps, and the largest logp_gap_max."""
    with tempfile.TemporaryDirectory() as tmp:
        settings = [
            *MOE_SETTINGS,
            *MODES[args.mode],
            f"algorithm.routing_replay={replay}",
            f"rollout.quantization={quantization}",
        ]
        cfg = e2e_config(args, model_dir, Path(tmp) / "run", settings)
        groups = build_groups(cfg)
        try:
            ctx = e2e_context(cfg, groups, args)
            steps = []
            for step in range(args.steps):
                steps.append(rl_step(ctx, step))
                if step == 0:
                    groups.freeze_heap()  # as the run loop does (rlloom/heap.py)
        finally:
            groups.close()
    if args.mode != "match_training" and "moe/route_mismatch_frac" not in steps[0]:
        sys.exit("bench_replay: the step reported no moe/route_mismatch_frac (is the model an MoE?)")
    out = {k: statistics.mean(m.get(k, float("nan")) for m in steps) for k in METRICS}
    out["rollout/logp_gap_max"] = max(m["rollout/logp_gap_max"] for m in steps)
    timed = steps[1:] or steps
    out["step_s"] = statistics.mean(m["time/step_s"] for m in timed)
    out["generate_s"] = statistics.mean(m["time/generate_s"] for m in timed)
    out["sync_s"] = statistics.mean(m["time/sync_s"] for m in timed)
    return out


def run_child(
    args: argparse.Namespace, model_dir: Path, mode: str, replay: str, quantization: str
) -> dict[str, float] | str:
    """`run` in a fresh process: its result line parsed, or why there is none."""
    argv = [sys.executable, __file__, *sys.argv[1:], "--child-model", str(model_dir), "--mode", mode,
            "--replay", replay, "--quantization", quantization]  # fmt: skip
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    }
    out = subprocess.run(argv, env=env, stdout=subprocess.PIPE, text=True)
    lines = [x for x in out.stdout.splitlines() if x.startswith(MARK)]
    if out.returncode != 0 or not lines:
        return f"failed (exit {out.returncode}; its error is above)"
    return json.loads(lines[-1].removeprefix(MARK))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="GRPO steps per setting")
    add_shape_args(parser)
    parser.add_argument("--child-model", default="", help=argparse.SUPPRESS)
    parser.add_argument("--replay", default="none", help=argparse.SUPPRESS)
    parser.add_argument("--quantization", default="none", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="default", choices=sorted(MODES), help=argparse.SUPPRESS)
    parser.add_argument("--fp8", action="store_true", help="also the settings with rollout.quantization=fp8")
    parser.add_argument(
        "--modes", type=parse_modes, default=["default"], help=f"comma-separated, of: {', '.join(MODES)}"
    )
    parser.set_defaults(**MOE_SHAPE)
    args = parser.parse_args()
    args.moe = True
    if args.tiny:
        tiny_shape(args)
    if args.child_model:
        print(
            MARK + json.dumps(run(args, Path(args.child_model), args.replay, args.quantization)), flush=True
        )
        return
    settings = [
        (mode, r, q)
        for mode in args.modes
        for q in (("none", "fp8") if args.fp8 and mode != "match_training" else ("none",))
        for r in (("none",) if mode == "match_training" else ("none", "rollout"))
    ]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model(Path(tmp) / "model", args)
        rows = {setting: run_child(args, model_dir, *setting) for setting in settings}
    model = "tiny Qwen3-MoE" if args.tiny else "Qwen3-30B-A3B width, 8 layers"
    print(f"\nbench_replay ({model}, {args.prompts} prompts x {args.samples}, "
          f"{args.prompt_tokens}+{args.new_tokens} tokens, {args.steps} steps)")  # fmt: skip
    print("| mode | algorithm.routing_replay | rollout.quantization | moe/route_mismatch_frac | rollout/logp_gap_abs | "
          "max rollout/logp_gap_max | rollout/token_mult_prob_error | step s | generate s | sync s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (mode, replay, quantization), r in rows.items():
        if isinstance(r, str):
            print(f"| {mode} | {replay} | {quantization} | {r} | | | | | | |")
            continue
        print(
            f"| {mode} | {replay} | {quantization} | {r['moe/route_mismatch_frac']:.4f} | "
            f"{r['rollout/logp_gap_abs']:.4f} | {r['rollout/logp_gap_max']:.4g} | "
            f"{r['rollout/token_mult_prob_error']:.4f} | {r['step_s']:.2f} | {r['generate_s']:.2f} | {r['sync_s']:.2f} |"
        )


if __name__ == "__main__":
    main()
