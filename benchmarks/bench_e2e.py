"""One GRPO step end to end on a GPU: generate -> reward -> update -> weight sync, with its breakdown.

Workload (issue: end-to-end loop): random Qwen3-0.6B weights (28 layers, hidden 1024, 16 heads,
8 KV heads, head dim 128, vocab 151936), 64 prompts x 8 samples, 128 prompt tokens, exactly 512
new tokens (ignore_eos), no reference model, bf16 compute with fp32 master weights, 32k-token
micro-batches with `train.gather_once_per_step` (FSDP gathers once per step). The reward is
a cheap deterministic function of the last token, so rewards vary inside groups and every group
trains. Steps after the first are steady state; the table reports their median.

    python benchmarks/bench_e2e.py                     # one GPU, inline
    python benchmarks/bench_e2e.py --workers 2         # Ray, one actor per GPU (colocated)
    python benchmarks/bench_e2e.py --rollout-workers 1 # Ray: 1 training GPU + 1 rollout GPU (separate)
    python benchmarks/bench_e2e.py --tiny --steps 2    # CPU smoke run of the script
    python benchmarks/bench_e2e.py --set algorithm.estimator=gae   # PPO with a critic (same model)
    python benchmarks/bench_e2e.py --profile           # + top device kernels of the last step
    python benchmarks/bench_e2e.py --profile-train     # the same for its policy update, + host ops
    python benchmarks/bench_e2e.py --modes default,deterministic,match_training   # one row per mode
    python benchmarks/bench_e2e.py --modes default,deterministic,deterministic --workers 2 --set parallel.tp=2
    python benchmarks/bench_e2e.py --moe --workers 2 --set parallel.ep=2   # Qwen3-30B-A3B width, 8 layers

`--modes` runs the step once per mode, each in a process of its own (deterministic kernels and
match_training's numerics are settings of the whole process): `default`, `deterministic`
(trainer.deterministic=true) and `match_training` (rollout.match_training=true), and prints one
table: the median step and its parts over the steps after the first, rollout tok/s, and the measured
train/rollout logprob gap (the largest rollout/logp_gap_max over the steps, and the mean
rollout/token_mult_prob_error). A mode that fails or runs past
`--mode-timeout-s` gets a row that says so. A mode listed twice runs twice, and its second row says
whether the repeat was identical: every step's metrics but timings (time/, perf/, sync/ms, memory/)
and a digest of the final weights (both runs save them, `save_hf`), as trainer.deterministic promises.

`--moe` takes a MoE model of Qwen3-30B-A3B's width (bench_moe.py's random weights) with
`--moe-layers` of its 48 layers (8 by default; --tiny: bench_moe's 2-layer toy).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from rlloom.cluster.build import Groups, build_groups
from rlloom.config import RunConfig, load_config
from rlloom.data.dataset import PromptItem
from rlloom.data.source import PromptSource
from rlloom.rewards.runner import RewardRunner
from rlloom.trainer.step import StepContext, rl_step


class LastTokenText:
    """The benchmark's response decoder (the step's `ResponseDecoder` contract): a response's text is
    its last token id, and it holds no control tokens."""

    def __call__(self, ids: list[int]) -> str:
        return str(ids[-1]) if ids else "0"

    def num_control(self, ids: list[int]) -> int:
        return 0


def last_token_parity(response_text: str, ground_truth: str) -> float:
    """Reward for the benchmark: 1 when the last generated token id is even (varies inside groups)."""
    return float(int(response_text or "0") % 2 == 0)


def write_random_qwen3(
    path: Path, *, tiny: bool, hidden: int = 1024, intermediate: int = 3072, max_positions: int = 4096
) -> Path:
    """Random bf16 Qwen3 weights in a Hugging Face folder: 28 layers of width `hidden` (the default:
    Qwen3-0.6B's shape; 2048/6144: Qwen3-1.7B's), or a 2-layer toy with `tiny`."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    shape = (
        dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=512)
        if tiny
        else dict(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936)
    )  # fmt: skip
    config = Qwen3Config(**shape, max_position_embeddings=max_positions, tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


def random_prompts(num: int, prompt_tokens: int, *, tiny: bool) -> list[PromptItem]:
    """`num` prompts of `prompt_tokens` random token ids (seeded: the same in every run)."""
    vocab = 512 if tiny else 151936
    rng = random.Random(0)
    return [
        PromptItem(
            prompt_ids=[rng.randrange(vocab) for _ in range(prompt_tokens)],
            prompt_text="",
            ground_truth="",
            index=i,
        )
        for i in range(num)
    ]


def profiled(fn, *, host_table: bool = False):  # noqa: ANN001, ANN201
    """fn() under torch.profiler; prints the top operators by self device time (and by self host
    time), and the fraction of the wall time the GPU spent in kernels."""
    import time

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        wall_s = time.perf_counter() - start
    averages = prof.key_averages()
    print(averages.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=60))
    if host_table:
        print(averages.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
    # Kernel rows have no host time of their own; the ops that launch them would count them twice.
    kernel_s = sum(e.self_device_time_total for e in averages if e.cpu_time_total == 0) / 1e6
    print(f"profiled wall {wall_s:.2f} s, GPU kernels {kernel_s:.2f} s, busy {kernel_s / wall_s:.2f}")
    return result


def add_shape_args(parser: argparse.ArgumentParser) -> None:
    """The workload's options (defaults: the T1 shape above); --tiny shrinks it for a CPU smoke run."""
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--kv-gb", type=float, default=40.0)
    parser.add_argument("--tiny", action="store_true")


def write_model(args: argparse.Namespace, path: Path) -> Path:
    """The benchmark's random checkpoint: Qwen3-0.6B's shape, or with --moe Qwen3-30B-A3B's width
    with --moe-layers layers (--tiny: the toys of each)."""
    if not args.moe:
        return write_random_qwen3(path, tiny=args.tiny)
    from bench_moe import QWEN3_30B_A3B_8L, TINY, write_random_checkpoint

    config = TINY if args.tiny else QWEN3_30B_A3B_8L | {"num_hidden_layers": args.moe_layers}
    return write_random_checkpoint(path, config)


def tiny_shape(args: argparse.Namespace) -> None:
    """--tiny: a few short prompts and a small KV cache (CPU smoke runs)."""
    args.prompts, args.samples, args.prompt_tokens, args.new_tokens, args.kv_gb = 4, 4, 16, 16, 0.1


def e2e_config(args: argparse.Namespace, model_dir: Path, run_dir: Path, extra: list[str]) -> RunConfig:
    """The benchmark's run config for `args` (prompts, samples, prompt/new tokens, kv_gb), plus `extra`."""
    overrides = [
        f"model.path={model_dir}",
        f"trainer.prompts_per_step={args.prompts}",
        f"rollout.n_samples={args.samples}",
        f"rollout.max_new_tokens={args.new_tokens}",
        "rollout.ignore_eos=true",
        "rollout.sleep_during_train=true",
        f"rollout.kv_cache_memory_gb={args.kv_gb}",
        f"rollout.max_num_seqs={args.prompts * args.samples}",
        f"data.max_prompt_length={args.prompt_tokens}",
        # 32k-token micro-batches (peak 58 GiB with the KV cache asleep) gathered once per step:
        # 10 micro-batches of FSDP copies and per-layer launches instead of 20 (train 3.8 -> 2.9 s).
        "train.max_tokens_per_micro_batch=32768",
        "train.gather_once_per_step=true",
        "train.lr=1e-6",
        f"trainer.run_dir={run_dir}",
    ]
    return load_config("arithmetic_demo", overrides + extra)


def e2e_context(
    cfg: RunConfig, groups: Groups, args: argparse.Namespace, items: list[PromptItem] | None = None
) -> StepContext:
    """One step context over `items` (default: random prompts for args.steps + 1 steps) and the parity
    reward."""
    if items is None:
        items = random_prompts(args.prompts * (args.steps + 1), args.prompt_tokens, tiny=args.tiny)
    return StepContext(
        cfg=cfg,
        train_group=groups.train,
        rollout_group=groups.rollout,
        weight_sync=groups.sync,
        source=PromptSource(items, seed=0),
        runner=RewardRunner(last_token_parity),
        decode=LastTokenText(),
        stop_token_ids=[],
        critic_group=groups.critic,
    )


MODES = {
    "default": [],
    "deterministic": ["trainer.deterministic=true"],
    "match_training": ["rollout.match_training=true"],
}
"""`--modes`: each mode's config overrides."""


def parse_modes(text: str) -> list[str]:
    """`--modes` "a,b" -> ["a", "b"], each one of MODES."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise argparse.ArgumentTypeError(
            f"modes are a comma-separated list of {', '.join(MODES)}; got {text!r}"
        )
    return modes


def without_modes(argv: list[str]) -> list[str]:
    """The command line minus its --modes option (and --out): what each mode's process runs."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--modes", "--out", "--mode-timeout-s"):
            skip = True
        elif not a.startswith(("--modes=", "--out=", "--mode-timeout-s=")):
            out.append(a)
    return out


NOT_REPEATABLE = ("time/", "perf/", "sync/ms", "memory/")
"""Metric prefixes a repeated run may change: timings and memory."""


def mode_summary(records: list[dict], gen_tokens: int) -> dict[str, float]:
    """One mode's row: medians over the steps after the first, the largest logp_gap_max over all
    steps, the mean token_mult_prob_error."""
    steady = records[1:] or records
    out = {
        k: statistics.median(r[k] for r in steady)
        for k in ("time/step_s", "time/generate_s", "time/train_s", "time/sync_s")
    }
    out["rollout_tok_s"] = gen_tokens / out["time/generate_s"]
    out["logp_gap_max"] = max(r.get("rollout/logp_gap_max", float("nan")) for r in records)
    out["token_mult_prob_error"] = statistics.mean(
        r.get("rollout/token_mult_prob_error", float("nan")) for r in records
    )
    return out


def repeat_verdict(first: dict, again: dict) -> str:
    """Whether a repeated mode's run (`{"records": [...], "weights": digest}`) gave the first one's
    metrics (all but timings) at every step and the same final weights."""
    for step, (a, b) in enumerate(zip(first["records"], again["records"], strict=True)):
        a, b = ({k: v for k, v in r.items() if not k.startswith(NOT_REPEATABLE)} for r in (a, b))
        differ = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
        if differ:
            return f"differs: step {step} {differ[0]}" + (f" (+{len(differ) - 1})" if len(differ) > 1 else "")
    return "identical" if first["weights"] == again["weights"] else "differs: final weights"


def run_mode(args: argparse.Namespace, mode: str, out: Path, digest: bool) -> dict | str:
    """One mode in a process of its own -> its result (`{"records", "weights"}`), or why it has none."""
    cmd = [sys.executable, __file__, *without_modes(sys.argv[1:]), "--out", str(out)]
    cmd += [f"--set={o}" for o in MODES[mode]] + (["--weights-digest"] if digest else [])
    print(f"== mode {mode}: {' '.join(cmd[1:])}", flush=True)
    try:  # its step lines shown, its own table not (one table); its stderr passes through
        proc = subprocess.run(cmd, timeout=args.mode_timeout_s or None, stdout=subprocess.PIPE, text=True)
    except subprocess.TimeoutExpired:
        return f"timed out after {args.mode_timeout_s} s"
    print("\n".join(line for line in proc.stdout.splitlines() if line.startswith("step ")), flush=True)
    if proc.returncode != 0 or not out.exists():
        return f"failed (exit {proc.returncode}; its error is above)"
    return json.loads(out.read_text())


def run_modes(args: argparse.Namespace) -> None:
    """--modes: each mode in a process of its own (a mode listed twice: twice, and compared); one table."""
    gen_tokens = args.prompts * args.samples * args.new_tokens
    rows, results = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, mode in enumerate(args.modes):
            result = run_mode(args, mode, Path(tmp) / f"{i}.json", args.modes.count(mode) > 1)
            if isinstance(result, str):
                rows.append((mode, result, ""))
                continue
            repeat = repeat_verdict(results[mode], result) if mode in results else ""
            results.setdefault(mode, result)
            rows.append((mode, mode_summary(result["records"], gen_tokens), repeat))
    steps = f"median of steps 2..{args.steps}" if args.steps > 1 else "one step"
    print(f"\n| mode ({args.prompts} prompts x {args.samples}, {args.prompt_tokens}+{args.new_tokens} tokens; {steps}) "
          "| step s | generate s | train s | sync s | rollout tok/s | max rollout/logp_gap_max | "
          "mean rollout/token_mult_prob_error | repeat of the mode's first run |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for mode, r, repeat in rows:
        name = f"{mode} ({', '.join(MODES[mode])})" if MODES[mode] else mode
        if isinstance(r, str):
            print(f"| {name} | {r} | | | | | | | |")
            continue
        print(f"| {name} | {r['time/step_s']:.3f} | {r['time/generate_s']:.3f} | {r['time/train_s']:.3f} | "
              f"{r['time/sync_s']:.3f} | {r['rollout_tok_s']:.0f} | {r['logp_gap_max']:.3g} | "
              f"{r['token_mult_prob_error']:.6f} | {repeat} |")  # fmt: skip
    base = next((r for mode, r, _ in rows if mode == "default" and isinstance(r, dict)), None)
    if base is not None:
        for mode, r, repeat in rows:
            if mode != "default" and isinstance(r, dict) and not repeat:
                print(f"{mode} / default: step {r['time/step_s'] / base['time/step_s']:.2f}x, "
                      f"rollout tok/s {r['rollout_tok_s'] / base['rollout_tok_s']:.2f}x")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(results))


def weights_digest(groups: Groups, folder: Path) -> str:
    """sha256 of the policy's weights as `save_hf` writes them (every rank's part, gathered)."""
    groups.train.save_hf(str(folder)).result()
    digest = hashlib.sha256()
    for f in sorted(folder.glob("*.safetensors")):
        digest.update(f.read_bytes())
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--workers", type=int, default=1, help="training ranks (cluster.num_workers)")
    parser.add_argument(
        "--rollout-workers",
        type=int,
        default=0,
        help="rollout GPUs of their own (cluster.placement=separate); 0 = colocated on the training GPUs",
    )
    add_shape_args(parser)
    parser.add_argument("--moe", action="store_true", help="a MoE model of Qwen3-30B-A3B's width")
    parser.add_argument("--moe-layers", type=int, default=8, help="--moe: its layers (of 48)")
    parser.add_argument("--out", default="")
    parser.add_argument("--profile", action="store_true", help="torch.profiler over the last step (inline)")
    parser.add_argument(
        "--profile-train", action="store_true", help="torch.profiler over the last step's policy update"
    )
    parser.add_argument(
        "--eager", action="store_true", help="no torch.compile (train layers, rollout decode)"
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="extra config override"
    )
    parser.add_argument(
        "--modes", type=parse_modes, default=None, help=f"comma-separated, of: {', '.join(MODES)} (one table)"
    )
    parser.add_argument("--mode-timeout-s", type=int, default=0, help="--modes: seconds per mode (0 = none)")
    parser.add_argument("--weights-digest", action="store_true", help=argparse.SUPPRESS)  # a repeated mode's
    args = parser.parse_args()
    if args.modes and (args.profile or args.profile_train):
        parser.error("--modes runs each mode in its own process: profile one mode with --set instead")
    if args.tiny:
        tiny_shape(args)
    if args.modes:
        return run_modes(args)

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model(args, Path(tmp) / "model")
        extra = ["train.compile=false", "rollout.compile=false"] if args.eager else []
        if args.workers > 1 or args.rollout_workers > 0:
            extra += ["cluster.mode=ray", f"cluster.num_workers={args.workers}"]
        if args.rollout_workers > 0:
            extra += ["cluster.placement=separate", f"cluster.rollout_workers={args.rollout_workers}"]
        cfg = e2e_config(args, model_dir, Path(tmp) / "run", extra + args.set)
        groups = build_groups(cfg)
        ctx = e2e_context(cfg, groups, args)
        records = []
        for step in range(args.steps):
            if args.profile_train and step == args.steps - 1:
                update = groups.train.update_policy
                groups.train.update_policy = lambda u, f=update: profiled(lambda: f(u), host_table=True)
            if args.profile and step == args.steps - 1:
                m = profiled(lambda s=step: rl_step(ctx, s))
            else:
                m = rl_step(ctx, step)
            if step == 0:
                groups.freeze_heap()  # as the run loop does (rlloom/heap.py)
            records.append(m)
            print(
                f"step {step}: {m['time/step_s']:.2f} s (generate {m['time/generate_s']:.2f}, "
                f"train {m['time/train_s']:.2f}, sync {m['time/sync_s']:.2f}), "
                f"mfu {m.get('perf/mfu', float('nan')):.3f}",
                flush=True,
            )
        weights = weights_digest(groups, Path(tmp) / "final") if args.weights_digest else None
        groups.close()
    steady = records[1:] or records
    keys = sorted(k for k in steady[0] if k.startswith("time/"))
    gen_tokens = args.prompts * args.samples * args.new_tokens
    print(
        f"\n| stage | median s ({len(steady)} steady steps, workers={args.workers}, "
        f"rollout_workers={args.rollout_workers}) |"
    )
    print("|---|---|")
    for k in keys:
        print(f"| {k} | {statistics.median(r[k] for r in steady):.3f} |")
    gen_s = statistics.median(r["time/generate_s"] for r in steady)
    print(f"| rollout tok/s | {gen_tokens / gen_s:.0f} |")
    print(f"| train MFU | {statistics.median(r.get('perf/mfu', 0.0) for r in steady):.3f} |")
    print(f"| weight sync ms/GB | {statistics.median(r['sync/ms_per_gb'] for r in steady):.0f} |")
    print(f"| peak memory GiB | {max(r.get('memory/peak_allocated_gib', 0.0) for r in steady):.1f} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"records": records, "weights": weights}))


if __name__ == "__main__":
    main()
