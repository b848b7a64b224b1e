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
    python benchmarks/bench_e2e.py --workers 2 --set parallel.tp=2 --set rollout.tp=2 \
        --modes default,deterministic,deterministic,match_training    # tp=2; the repeat compared
    python benchmarks/bench_e2e.py --moe --workers 2 --set parallel.ep=2 --modes ...  # MoE, ep=2

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

`--multiturn` runs bench_multiturn.py's episodes through the step (multiturn_env.py): the same 512
sampled tokens per trajectory in `--turns` 4 turns of 128, after each of the first 3 a 50 ms tool
(`--tool-ms`) and an observation of 32 tokens (`--obs-tokens`: its message and the chat template's turn
markers), as a `rollout.env` in `--env-workers` 128 environment worker processes (a worker runs one
call at a time: 512 trajectories' tool calls take 4 x 50 ms per turn where bench_multiturn.py's all
overlap; `--env-workers 512` for that, at ~150 MB of host memory a worker). Rollout tok/s counts
sampled tokens (observations not), and the tables add rollout/turns_mean.

`--placements colocated,separate` runs the step once per placement on `--gpus` 2 GPUs, each in a
process of its own like `--modes`: `colocated` (`--workers 2`: every GPU trains and generates) and
`separate` (`--workers 1 --rollout-workers 1`: cluster.placement=separate), one table with the ratio
of each to the first:

    python benchmarks/bench_e2e.py --multiturn --placements colocated,separate   # 2 GPUs, one call
    python benchmarks/bench_e2e.py --multiturn --tiny --steps 2 --placements colocated,separate  # CPU
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
from collections.abc import Sequence
from pathlib import Path

import torch
from bounded import run_bounded  # beside this file
from multiturn_env import (  # beside this file
    FixedLengthTurns,
    bench_tokenizer,
    chat_prompts,
    multiturn_overrides,
    observation_text,
)

from rlloom.cluster.build import Groups, build_groups
from rlloom.config import RunConfig, load_config
from rlloom.data.dataset import PromptItem
from rlloom.data.source import PromptSource
from rlloom.episodes.build import build_episode_driver
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


def write_model(args: argparse.Namespace, path: Path) -> Path:
    """The benchmark's random checkpoint: Qwen3-0.6B's shape, or with --moe Qwen3-30B-A3B's width
    with --moe-layers layers (--tiny: the toys of each)."""
    if not args.moe:
        return write_random_qwen3(path, tiny=args.tiny)
    from bench_moe import QWEN3_30B_A3B_8L, TINY, write_random_checkpoint

    config = TINY if args.tiny else QWEN3_30B_A3B_8L | {"num_hidden_layers": args.moe_layers}
    return write_random_checkpoint(path, config)


def add_shape_args(parser: argparse.ArgumentParser) -> None:
    """The workload's options (defaults: the T1 shape above); --tiny shrinks it for a CPU smoke run."""
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--kv-gb", type=float, default=40.0)
    parser.add_argument("--tiny", action="store_true")


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
    cfg: RunConfig,
    groups: Groups,
    args: argparse.Namespace,
    items: list[PromptItem] | None = None,
    episodes: object = None,
) -> StepContext:
    """One step context over `items` (default: random prompts for args.steps + 1 steps) and the parity
    reward; `episodes`: a multi-turn episode driver (`multiturn_parts`)."""
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
        episodes=episodes,
    )


def add_multiturn_args(parser: argparse.ArgumentParser) -> None:
    """--multiturn and its workload (defaults: bench_multiturn.py's)."""
    parser.add_argument(
        "--multiturn", action="store_true", help="bench_multiturn.py's episodes (multiturn_env.py)"
    )
    parser.add_argument(
        "--turns", type=int, default=4, help="--multiturn: turns sharing --new-tokens equally"
    )
    parser.add_argument("--obs-tokens", type=int, default=32, help="--multiturn: tokens an observation adds")
    parser.add_argument("--tool-ms", type=float, default=50.0, help="--multiturn: the tool's time per call")
    parser.add_argument("--env-workers", type=int, default=128, help="--multiturn: environment processes")


def turn_tokens(args: argparse.Namespace) -> int:
    """Sampled tokens per turn: --new-tokens over --turns (single-turn: all of them)."""
    return args.new_tokens // args.turns if args.multiturn else args.new_tokens


def multiturn_overrides_of(args: argparse.Namespace) -> list[str]:
    """--multiturn's config overrides (ValueError for a shape it cannot run)."""
    if args.new_tokens % args.turns:
        raise ValueError(f"--new-tokens {args.new_tokens} is not a multiple of --turns {args.turns}")
    return multiturn_overrides(
        turns=args.turns,
        turn_tokens=turn_tokens(args),
        prompt_tokens=args.prompt_tokens,
        obs_tokens=args.obs_tokens,
        tool_s=args.tool_ms / 1000,
        env_workers=args.env_workers,
        observation=observation_text(bench_tokenizer(), args.obs_tokens),
    )


def multiturn_parts(cfg: RunConfig, args: argparse.Namespace) -> tuple[list[PromptItem], FixedLengthTurns]:
    """--multiturn's chat prompts (for args.steps + 1 steps) and episode driver (its environment
    workers start now)."""
    tokenizer = bench_tokenizer()
    items = chat_prompts(tokenizer, args.prompts * (args.steps + 1), args.prompt_tokens)
    # Every turn ends at its length, none at a stop token: an assistant message is all its tokens' text
    # (a final control token, which rlloom's decoding leaves out as the stop token, too).
    text = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    driver = build_episode_driver(cfg, tokenizer, [], text)
    return items, FixedLengthTurns(driver)


MODES = {
    "default": [],
    "deterministic": ["trainer.deterministic=true"],
    "match_training": ["rollout.match_training=true"],
}
"""`--modes`: each mode's config overrides."""

PLACEMENTS = ("colocated", "separate")
"""`--placements`: on `--gpus` G GPUs, colocated = G training ranks, each with a rollout replica;
separate = G - 1 training GPUs and 1 rollout GPU."""


def parse_names(text: str, known: Sequence[str], option: str) -> list[str]:
    """`text` "a,b" -> ["a", "b"], each one of `known` (the `option` that took it)."""
    names = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in names if m not in known]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"{option} are a comma-separated list of {', '.join(known)}; got {text!r}"
        )
    return names


def parse_modes(text: str) -> list[str]:
    """`--modes` "a,b" -> ["a", "b"], each one of MODES."""
    return parse_names(text, list(MODES), "modes")


def parse_placements(text: str) -> list[str]:
    """`--placements` "a,b" -> ["a", "b"], each one of PLACEMENTS."""
    return parse_names(text, PLACEMENTS, "placements")


VARIANT_OPTIONS = ("--modes", "--placements", "--gpus", "--out", "--mode-timeout-s")
"""The options of the parent process alone (each variant's process runs without them)."""


def without_modes(argv: list[str]) -> list[str]:
    """The command line minus its --modes/--placements options (and --out, --gpus, --mode-timeout-s):
    what each variant's process runs."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in VARIANT_OPTIONS:
            skip = True
        elif not a.startswith(tuple(f"{o}=" for o in VARIANT_OPTIONS)):
            out.append(a)
    return out


def variants(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """(row name, the variant process's extra arguments) for each of --modes or --placements."""
    if args.modes:  # a repeated mode's runs digest their final weights (`repeat_verdict`)
        return [
            (
                f"{m} ({', '.join(MODES[m])})" if MODES[m] else m,
                [f"--set={o}" for o in MODES[m]] + (["--weights-digest"] if args.modes.count(m) > 1 else []),
            )
            for m in args.modes
        ]
    g = args.gpus
    layouts = {
        "colocated": (f"colocated ({g} GPUs, each training and generating)", g, 0),
        "separate": (f"separate ({g - 1} training + 1 rollout GPU)", g - 1, 1),
    }
    return [
        (name, ["--workers", str(workers), "--rollout-workers", str(rollout)])
        for name, workers, rollout in (layouts[p] for p in args.placements)
    ]


def mode_summary(records: list[dict], gen_tokens: int) -> dict[str, float]:
    """One variant's row: medians over the steps after the first, the largest logp_gap_max over all
    steps, the mean token_mult_prob_error. `gen_tokens`: sampled tokens of a step's turn (a
    multi-turn step's are that times rollout/turns_mean)."""
    steady = records[1:] or records
    out = {
        k: statistics.median(r[k] for r in steady)
        for k in ("time/step_s", "time/generate_s", "time/train_s", "time/sync_s")
    }
    out["turns_mean"] = statistics.median(r.get("rollout/turns_mean", 1.0) for r in steady)
    out["rollout_tok_s"] = gen_tokens * out["turns_mean"] / out["time/generate_s"]
    out["logp_gap_max"] = max(r.get("rollout/logp_gap_max", float("nan")) for r in records)
    out["token_mult_prob_error"] = statistics.mean(
        r.get("rollout/token_mult_prob_error", float("nan")) for r in records
    )
    return out


NOT_REPEATABLE = ("time/", "perf/", "sync/ms", "memory/")
"""Metric prefixes a repeated run may change: timings and memory."""


def repeat_verdict(first: list[dict], again: list[dict]) -> str:
    """Whether a repeated mode's run gave the first run's metrics (all but timings) at every step,
    the digest of the final weights (`weights_sha256`, in the last step's record) included."""
    for step, (a, b) in enumerate(zip(first, again, strict=True)):
        a, b = ({k: v for k, v in r.items() if not k.startswith(NOT_REPEATABLE)} for r in (a, b))
        differ = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
        if differ:
            return f"differs: step {step} {differ[0]}" + (f" (+{len(differ) - 1})" if len(differ) > 1 else "")
    return "identical"


def weights_digest(groups: Groups, folder: Path) -> str:
    """sha256 of the policy's weights as `save_hf` writes them (every rank's part, gathered)."""
    groups.train.save_hf(str(folder)).result()
    digest = hashlib.sha256()
    for f in sorted(folder.glob("*.safetensors")):
        digest.update(f.read_bytes())
    return digest.hexdigest()


def run_variant(args: argparse.Namespace, name: str, extra: list[str], out: Path) -> dict | str:
    """One variant in a process of its own: its records, or why there are none. Its step lines are
    shown, its own table not (one table); its stderr passes through."""
    cmd = [sys.executable, __file__, *without_modes(sys.argv[1:]), *extra, "--out", str(out)]
    print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
    proc = run_bounded(cmd, args.mode_timeout_s, stdout=subprocess.PIPE, text=True)
    if proc is None:  # its process tree (its Ray instance included) was killed
        return f"timed out after {args.mode_timeout_s} s"
    print("\n".join(line for line in proc.stdout.splitlines() if line.startswith("step ")), flush=True)
    if proc.returncode != 0 or not out.exists():
        return f"failed (exit {proc.returncode}; its error is above)"
    return json.loads(out.read_text())


def run_modes(args: argparse.Namespace) -> None:
    """--modes or --placements: each variant in a process of its own; one table, and each variant's
    step and rollout rate against the first's."""
    gen_tokens = args.prompts * args.samples * turn_tokens(args)
    rows, all_records = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, extra) in enumerate(variants(args)):
            result, repeat = run_variant(args, name, extra, Path(tmp) / f"{i}.json"), ""
            if isinstance(result, list):
                repeat = repeat_verdict(all_records[name], result) if name in all_records else ""
                all_records.setdefault(name, result)
                result = mode_summary(result, gen_tokens)
            rows.append((name, result, repeat))
    steps = f"median of steps 2..{args.steps}" if args.steps > 1 else "one step"
    kind = "mode" if args.modes else "placement"
    shape = f"{args.prompts} prompts x {args.samples}, {args.prompt_tokens}+{args.new_tokens} tokens"
    if args.multiturn:
        shape += f" in {args.turns} turns, tool {args.tool_ms:g} ms + {args.obs_tokens} tokens"
    print(f"\n| {kind} ({shape}; {steps}) | step s | generate s | train s | sync s | rollout tok/s | "
          "max rollout/logp_gap_max | mean rollout/token_mult_prob_error | rollout/turns_mean | "
          "repeat of its first run |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r, repeat in rows:
        if isinstance(r, str):
            print(f"| {name} | {r} | | | | | | | | |")
            continue
        print(f"| {name} | {r['time/step_s']:.3f} | {r['time/generate_s']:.3f} | {r['time/train_s']:.3f} | "
              f"{r['time/sync_s']:.3f} | {r['rollout_tok_s']:.0f} | {r['logp_gap_max']:.3g} | "
              f"{r['token_mult_prob_error']:.6f} | {r['turns_mean']:.2f} | {repeat} |")  # fmt: skip
    base_name, base, _ = rows[0]
    if isinstance(base, dict):
        for name, r, repeat in rows[1:]:
            if isinstance(r, dict) and not repeat:
                print(f"{name.split(' (')[0]} / {base_name.split(' (')[0]}: step "
                      f"{r['time/step_s'] / base['time/step_s']:.2f}x, "
                      f"rollout tok/s {r['rollout_tok_s'] / base['rollout_tok_s']:.2f}x")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(all_records))


def run_steps(args: argparse.Namespace) -> list[dict[str, float]]:
    """The benchmark's steps in this process: their metrics."""
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model(args, Path(tmp) / "model")
        extra = ["train.compile=false", "rollout.compile=false"] if args.eager else []
        if args.workers > 1 or args.rollout_workers > 0:
            extra += ["cluster.mode=ray", f"cluster.num_workers={args.workers}"]
        if args.rollout_workers > 0:
            extra += ["cluster.placement=separate", f"cluster.rollout_workers={args.rollout_workers}"]
        if args.multiturn:
            extra += multiturn_overrides_of(args)
        cfg = e2e_config(args, model_dir, Path(tmp) / "run", extra + args.set)
        groups = build_groups(cfg)
        items, episodes = multiturn_parts(cfg, args) if args.multiturn else (None, None)
        ctx = e2e_context(cfg, groups, args, items, episodes)
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
            turns = f", turns {m['rollout/turns_mean']:.2f}" if args.multiturn else ""
            print(
                f"step {step}: {m['time/step_s']:.2f} s (generate {m['time/generate_s']:.2f}, "
                f"train {m['time/train_s']:.2f}, sync {m['time/sync_s']:.2f}), "
                f"mfu {m.get('perf/mfu', float('nan')):.3f}{turns}",
                flush=True,
            )
        if episodes is not None:
            episodes.close()
        if args.weights_digest:
            records[-1]["weights_sha256"] = weights_digest(groups, Path(tmp) / "final")
        groups.close()
    return records


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
    add_multiturn_args(parser)
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
    parser.add_argument(
        "--placements",
        type=parse_placements,
        default=None,
        help=f"comma-separated, of: {', '.join(PLACEMENTS)} (one table), on --gpus GPUs",
    )
    parser.add_argument("--gpus", type=int, default=2, help="--placements: GPUs of each placement")
    parser.add_argument("--mode-timeout-s", type=int, default=0, help="--modes: seconds per mode (0 = none)")
    parser.add_argument("--weights-digest", action="store_true", help=argparse.SUPPRESS)  # a repeated mode's
    args = parser.parse_args()
    if (args.modes or args.placements) and (args.profile or args.profile_train):
        parser.error(
            "--modes/--placements run each variant in its own process: profile one with --set instead"
        )
    if args.modes and args.placements:
        parser.error("--modes and --placements: one of them per call (one table)")
    if args.placements and "separate" in args.placements and args.gpus < 2:
        parser.error(f"--gpus {args.gpus}: a separate placement needs 2 GPUs or more")
    if args.tiny:
        tiny_shape(args)
        args.obs_tokens, args.env_workers = 12, 2  # --multiturn: 2 tokens of text beside the markers
    if args.multiturn:
        try:
            multiturn_overrides_of(args)
        except ValueError as e:
            parser.error(str(e))
    if args.modes or args.placements:
        return run_modes(args)

    records = run_steps(args)
    steady = records[1:] or records
    keys = sorted(k for k in steady[0] if k.startswith("time/"))
    print(
        f"\n| stage | median s ({len(steady)} steady steps, workers={args.workers}, "
        f"rollout_workers={args.rollout_workers}) |"
    )
    print("|---|---|")
    for k in keys:
        print(f"| {k} | {statistics.median(r[k] for r in steady):.3f} |")
    summary = mode_summary(records, args.prompts * args.samples * turn_tokens(args))
    print(f"| rollout tok/s | {summary['rollout_tok_s']:.0f} |")
    if args.multiturn:
        print(f"| rollout/turns_mean | {summary['turns_mean']:.2f} |")
        print(
            f"| rollout/env_tokens_mean | {statistics.median(r['rollout/env_tokens_mean'] for r in steady):.1f} |"
        )
    print(f"| train MFU | {statistics.median(r.get('perf/mfu', 0.0) for r in steady):.3f} |")
    print(f"| weight sync ms/GB | {statistics.median(r['sync/ms_per_gb'] for r in steady):.0f} |")
    print(f"| peak memory GiB | {max(r.get('memory/peak_allocated_gib', 0.0) for r in steady):.1f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(records))


if __name__ == "__main__":
    main()
