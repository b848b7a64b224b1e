"""Recovery from a killed Ray worker, through `rlloom train`: the time from a kill -9 to the next
completed step, and the run's final weights and metrics against the uninterrupted run's.

Each case is one `python -m rlloom.cli train` process (cluster.mode=ray, `trainer.deterministic=true`,
so runs of one config are comparable bit for bit) on a model folder this script writes:

- GPU (default): random bf16 weights of the Qwen3-0.6B shape (28 layers, hidden 1024, 16 heads, 8 KV
  heads, head dim 128, vocabulary 151936; as benchmarks/bench_e2e.py) with a character tokenizer
  filled up to the model's vocabulary (`rlloom.models.tiny.char_tokenizer(vocab_size=...)`). A
  smaller batch than T1: 16 prompts x 8 samples x 256 new tokens (ignore_eos), 3 steps, the
  arithmetic task's prompts (64 tokens with the chat template), lr 1e-4 (the bf16 rollout weights
  change every step, so a rollout on stale weights would give other samples), bench_e2e's 32k-token
  micro-batches; `cluster.timeout_s=120`. T1's batch: `--prompts 64 --new-tokens 512 --kv-gb 40`.
- `--tiny` (CPU smoke run): the tiny dense test model (`rlloom init-model tiny-dense`), 4 prompts x
  4 x 16 tokens, lr 3e-2, `cluster.timeout_s=300`, at least 600 s a case (actors start slowly on a
  busy CPU machine).

The reward is the parity of the response text's CRC-32 (varies inside groups, so every group trains).
`trainer.save_every=1` (a training restart loads step k-1's checkpoint), `keep_last_checkpoints=1`,
no evaluation, no Hugging Face export.

Placements (`--placements`): `separate` (cluster.placement=separate: 1 training GPU + 1 rollout GPU)
and `colocated` (2 workers, each a training rank and a rollout replica on one GPU). Cases
(`--cases`, after the uninterrupted run `none`, which always runs first), each fault set with
`RLLOOM_FAULT` and fired once (`RLLOOM_FAULT_ONCE`), in step `--kill-step` (default 2):
- `rollout`: rollout rank 0 kills itself (SIGKILL) as its generation call of that step starts
  (`RLLOOM_FAULT=rollout:VERSION:0`). Separate placement replaces the replica in place; colocated,
  where that process also holds training rank 0, restarts the run from the checkpoint.
- `train`: the last training rank (0 separate, 1 colocated) kills itself as its policy update of that
  step starts (`RLLOOM_FAULT=update_policy:VERSION:RANK`): the run restarts from step k-1's checkpoint.

How the times are measured: the kill's time is the modification time of the `RLLOOM_FAULT_ONCE` file,
which the dying process creates right before it sends itself SIGKILL (`rlloom/faults.py`); a step's
time is when this script first sees its record in RUN_DIR/metrics.jsonl (read every 50 ms; the run
flushes each line). `kill -> step k s` is step k's time minus the kill's; `step k-1 -> k s` is the
time between the two records in that run (it includes step k-1's checkpoint save), and the
uninterrupted run's same interval is the normal step's time, next to its `time/step_s`;
`lost s` is the difference of the two intervals: what the failure cost. A kill mid-generation
instead of at its start would lose up to one more generation.

Weights: the final checkpoint's model tensors (fp32 master weights on a GPU) against the
uninterrupted run's, bitwise and max |diff|. Metrics: every record's values except times, speeds,
memory and `cluster/` counts, exactly. Each case has `--case-timeout-s`; a case that fails or runs
past it gives a row that says so (its log's last lines follow the table). The table is printed row
by row and, with OUT (or --out) set, written to OUT/bench_recovery.md and .json after every row,
each case's log to OUT/bench_recovery_logs/.

GPU runs with NVLink multicast off keep NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 in
the environment: the run's processes inherit it and rlloom passes every NCCL_*/TORCH_*/RLLOOM_*
variable to its Ray actors (cluster/ray_slots.py); the uninterrupted run checks each actor's
/proc/PID/environ for them and says so under the table.

    python benchmarks/bench_recovery.py                                  # 2 GPUs, both placements (6 runs)
    python benchmarks/bench_recovery.py --placements separate            # 2 GPUs, one placement (3 runs)
    python benchmarks/bench_recovery.py --placements colocated --workers 1   # 1 GPU (no in-place replica)
    python benchmarks/bench_recovery.py --tiny                           # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

SKIP = ("time/", "perf/", "sync/ms", "memory/", "cluster/")
"""Metrics that differ between equal runs (times, speeds, memory) or count the restarts themselves."""
PASSED_ENV = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST")
"""The variables a GPU run on a machine without NVLink multicast needs in every process."""
REWARD = '''"""bench_recovery.py's reward: the parity of the response text's CRC-32 (varies inside groups)."""
import zlib


def crc_parity(response_text: str, ground_truth: str) -> float:
    return float(zlib.crc32(response_text.encode()) % 2)
'''
QWEN3_0_6B = dict(
    hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, vocab_size=151936,
)  # fmt: skip


@dataclass(slots=True)
class Row:
    """One case's results (a table row and a record of bench_recovery.json)."""

    placement: str
    case: str
    fault: str
    exit_code: int | None = None
    rollout_restarts: int = 0
    train_restarts: int = 0
    kill_to_step_s: float | None = None
    interval_s: float | None = None
    normal_interval_s: float | None = None
    normal_step_s: float | None = None
    weights: str = ""
    weights_max_diff: float | None = None
    metrics: str = ""
    wall_s: float = 0.0
    note: str = ""
    step_seen_s: dict[int, float] = field(default_factory=dict)
    """When each step's record was first seen, seconds after the process started."""


def write_model(path: Path, *, tiny: bool) -> Path:
    """The run's model folder: the tiny dense test model, or random bf16 Qwen3-0.6B-shape weights with
    the character tokenizer filled up to its vocabulary."""
    from rlloom.models.tiny import char_tokenizer, write_tiny_model

    if tiny:
        return write_tiny_model("tiny-dense", path)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = char_tokenizer(vocab_size=QWEN3_0_6B["vocab_size"])
    vocab = tokenizer.get_vocab()
    config = Qwen3Config(
        **QWEN3_0_6B, max_position_embeddings=4096, tie_word_embeddings=True,
        eos_token_id=vocab["<|im_end|>"], pad_token_id=vocab["<pad>"], bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def overrides(args: argparse.Namespace, placement: str, model_dir: Path, run_dir: Path) -> list[str]:
    """`rlloom train arithmetic_demo` overrides of every case of `placement`."""
    out = [
        f"model.path={model_dir}",
        f"trainer.run_dir={run_dir}",
        f"trainer.total_steps={args.steps}",
        f"trainer.prompts_per_step={args.prompts}",
        "trainer.save_every=1",
        "trainer.keep_last_checkpoints=1",
        "trainer.save_hf_every=-1",
        "trainer.deterministic=true",
        "data.num_eval=0",
        f"rollout.n_samples={args.samples}",
        f"rollout.max_new_tokens={args.new_tokens}",
        "rollout.ignore_eos=true",
        f"rollout.max_num_seqs={args.prompts * args.samples}",
        f"train.lr={args.lr}",
        "reward.name=bench_reward:crc_parity",
        f"reward.import_dir={model_dir.parent}",
        "cluster.mode=ray",
        f"cluster.timeout_s={args.cluster_timeout_s}",
        "logging.console=true",
    ]
    if not args.tiny:
        out += [  # bench_e2e.py's GPU settings
            f"rollout.kv_cache_memory_gb={args.kv_gb}",
            "rollout.sleep_during_train=true",
            "train.max_tokens_per_micro_batch=32768",
            "train.gather_once_per_step=true",
        ]
    if placement == "separate":
        out += ["cluster.placement=separate", "cluster.num_workers=1", "cluster.rollout_workers=1"]
    else:
        out += ["cluster.placement=colocated", f"cluster.num_workers={args.workers}"]
    return out + args.set


def fault_spec(case: str, args: argparse.Namespace, placement: str) -> str:
    """The RLLOOM_FAULT of `case` ('' for none). One optimizer step a step: the policy version at
    step k's start is k - 1."""
    version = args.kill_step - 1
    if case == "rollout":
        return f"rollout:{version}:0"
    if case == "train":
        return f"update_policy:{version}:{args.workers - 1 if placement == 'colocated' else 0}"
    return ""


def read_records(path: Path) -> list[dict]:
    """metrics.jsonl's complete records (a line being written is skipped)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def actor_env_check(run_dir: Path) -> str | None:
    """Whether every actor in RUN_DIR/actors.json has PASSED_ENV's variables (those set here) with
    this process's values in its /proc/PID/environ; None while actors.json is not written yet."""
    want = {k: os.environ[k] for k in PASSED_ENV if k in os.environ}
    try:
        actors = json.loads((run_dir / "actors.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    seen = []
    for a in actors:
        try:
            raw = Path(f"/proc/{a['pid']}/environ").read_bytes()
        except OSError as e:
            return f"{a['role']} rank {a['rank']} (pid {a['pid']}): environment not readable ({e})"
        env = dict(x.split("=", 1) for x in raw.decode(errors="replace").split("\0") if "=" in x)
        missing = [k for k in want if env.get(k) != want[k]]
        seen.append(f"{a['role']} {a['rank']}: " + (f"missing {', '.join(missing)}" if missing else "ok"))
    return (
        f"actors' environments ({', '.join(f'{k}={v}' for k, v in want.items()) or 'none set'}): "
        + "; ".join(seen)
    )


def run_case(
    args: argparse.Namespace, placement: str, case: str, model_dir: Path, work: Path
) -> tuple[Row, Path]:
    """Run `case` in a process of its own and time its steps; the row (its comparison fields left
    empty) and the run folder."""
    run_dir = work / placement / case
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    once = run_dir.parent / f"{case}.fired"
    spec = fault_spec(case, args, placement)
    env = {k: v for k, v in os.environ.items() if k not in ("RLLOOM_FAULT", "RLLOOM_FAULT_ONCE")}
    if spec:
        env.update(RLLOOM_FAULT=spec, RLLOOM_FAULT_ONCE=str(once))
    row = Row(placement=placement, case=case, fault=spec or "-")
    cmd = [sys.executable, "-m", "rlloom.cli", "train", "arithmetic_demo",
           *overrides(args, placement, model_dir, run_dir)]  # fmt: skip
    log_path = run_dir.parent / f"{case}.log"
    start = time.time()
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + args.case_timeout_s
        while proc.poll() is None and time.monotonic() < deadline:
            for r in read_records(run_dir / "metrics.jsonl"):
                row.step_seen_s.setdefault(r["step"], time.time() - start)
            if case == "none" and not row.note:
                row.note = actor_env_check(run_dir) or ""
            time.sleep(0.05)
        if proc.poll() is None:  # its Ray processes are in its session
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            row.note = f"timed out after {args.case_timeout_s} s"
    for r in read_records(run_dir / "metrics.jsonl"):
        row.step_seen_s.setdefault(r["step"], time.time() - start)
    row.exit_code, row.wall_s = proc.returncode, time.time() - start
    records = read_records(run_dir / "metrics.jsonl")
    row.rollout_restarts = int(max((r.get("cluster/rollout_restarts") or 0 for r in records), default=0))
    row.train_restarts = int(max((r.get("cluster/train_restarts") or 0 for r in records), default=0))
    k = args.kill_step
    if k in row.step_seen_s and k - 1 in row.step_seen_s:
        row.interval_s = row.step_seen_s[k] - row.step_seen_s[k - 1]
    if spec and once.exists() and k in row.step_seen_s:
        row.kill_to_step_s = start + row.step_seen_s[k] - once.stat().st_mtime
    elif spec and not once.exists():
        row.note = (row.note + "; " if row.note else "") + "the fault never fired"
    return row, run_dir


def set_normal(base: Row, run_dir: Path, kill_step: int) -> None:
    """The uninterrupted run's step k-1 -> k interval and step k's `time/step_s`: the normal step."""
    base.normal_interval_s = base.interval_s
    records = read_records(run_dir / "metrics.jsonl")
    base.normal_step_s = next((r.get("time/step_s") for r in records if r["step"] == kill_step), None)


def compare(row: Row, run_dir: Path, base: Row | None, base_dir: Path, args: argparse.Namespace) -> None:
    """Fill `row`'s comparison with the uninterrupted run `base` (weights, metrics, the normal step)."""
    from rlloom.trainer.checkpoint import checkpoint_dir, checkpoint_model_tensors

    if base is None or base.exit_code != 0:
        row.weights = row.metrics = "no baseline"
        return
    row.normal_interval_s, row.normal_step_s = base.normal_interval_s, base.normal_step_s
    base_records = read_records(base_dir / "metrics.jsonl")
    if row.exit_code != 0:
        row.weights = row.metrics = "-"
        return
    try:
        a, b = (checkpoint_model_tensors(checkpoint_dir(d, args.steps)) for d in (base_dir, run_dir))
    except Exception as e:  # noqa: BLE001 (a missing or damaged checkpoint is a result to report)
        row.weights = f"unreadable: {type(e).__name__}: {e}"
    else:
        if a.keys() != b.keys():
            row.weights = "different tensors"
        else:
            diffs = [(x.float() - b[n].float()).abs().max().item() for n, x in a.items()]
            row.weights_max_diff = max(diffs, default=0.0)
            row.weights = "yes" if all(torch.equal(x, b[n]) for n, x in a.items()) else "no"
    row.metrics = metrics_equal(base_records, read_records(run_dir / "metrics.jsonl"))


def metrics_equal(a: list[dict], b: list[dict]) -> str:
    """'yes' when every record holds the same values (SKIP aside), else where they first differ."""
    if [r["step"] for r in a] != [r["step"] for r in b]:
        return f"no: steps {[r['step'] for r in a]} vs {[r['step'] for r in b]}"
    for ra, rb in zip(a, b):
        ka, kb = ({k for k in r if not k.startswith(SKIP)} for r in (ra, rb))
        if ka != kb:
            return f"no: step {ra['step']} keys differ ({sorted(ka ^ kb)[:3]})"
        bad = [k for k in sorted(ka) if ra[k] != rb[k]]
        if bad:
            return f"no: step {ra['step']}, {len(bad)} keys ({bad[0]}: {ra[bad[0]]} vs {rb[bad[0]]})"
    return "yes"


def fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def header(args: argparse.Namespace) -> list[str]:
    k = args.kill_step
    shape = f"{args.prompts} prompts x {args.samples} x {args.new_tokens} tokens, {args.steps} steps"
    return [
        f"| placement | case ({shape}; kill in step {k}) | RLLOOM_FAULT | exit | rollout_restarts | "
        f"train_restarts | kill -> step {k} s | step {k - 1} -> {k} s | normal step {k - 1} -> {k} s "
        f"(time/step_s) | lost s | weights equal (max abs diff) | metrics equal | run s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]


def table_line(r: Row) -> str:
    timed = r.case != "none" and r.interval_s is not None and r.normal_interval_s is not None
    lost = r.interval_s - r.normal_interval_s if timed else None
    weights = r.weights if r.weights_max_diff is None else f"{r.weights} ({r.weights_max_diff:.3g})"
    normal = f"{fmt(r.normal_interval_s)} ({fmt(r.normal_step_s, 2)})"
    return (
        f"| {r.placement} | {r.case} | {r.fault} | {r.exit_code} | {r.rollout_restarts} | "
        f"{r.train_restarts} | {fmt(r.kill_to_step_s)} | {fmt(r.interval_s)} | {normal} | {fmt(lost)} | "
        f"{weights or '-'} | "
        f"{r.metrics or '-'} | {r.wall_s:.0f} |"
    )


def notes(rows: list[Row], work: Path) -> list[str]:
    """Under the table: each case's note, restart lines and, for a failed case, its log's last lines."""
    out = []
    for r in rows:
        log = work / r.placement / f"{r.case}.log"
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        said = [x.strip() for x in lines if " restart " in x and "of trainer.max_restarts" in x]
        if r.note:
            out.append(f"- {r.placement}/{r.case}: {r.note}")
        out += [f"- {r.placement}/{r.case}: {x[:400]}" for x in said]
        if r.exit_code != 0:
            out += [f"- {r.placement}/{r.case} log: {x[:400]}" for x in lines[-15:]]
    return out


def save(out_dir: str, lines: list[str], rows: list[Row], work: Path) -> None:
    """bench_recovery.md (the table), .json (every row) and each case's log (its last MB, in
    bench_recovery_logs/) in `out_dir`; nothing without one."""
    if not out_dir:
        return
    logs = Path(out_dir) / "bench_recovery_logs"
    logs.mkdir(parents=True, exist_ok=True)
    for r in rows:
        log = work / r.placement / f"{r.case}.log"
        if log.exists():
            (logs / f"{r.placement}-{r.case}.log").write_bytes(log.read_bytes()[-(2**20) :])
    (Path(out_dir) / "bench_recovery.md").write_text("\n".join(lines) + "\n")
    (Path(out_dir) / "bench_recovery.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--placements", default="separate,colocated", help="comma-separated: separate, colocated"
    )
    parser.add_argument(
        "--cases", default="rollout,train", help="comma-separated: rollout, train (after none)"
    )
    parser.add_argument("--workers", type=int, default=2, help="colocated: training ranks (GPUs)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--kill-step", type=int, default=2, help="the step (1-based) the faults fire in")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--kv-gb", type=float, default=8.0, help="rollout.kv_cache_memory_gb (GPU)")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--case-timeout-s", type=int, default=240)
    parser.add_argument("--cluster-timeout-s", type=float, default=120.0, help="cluster.timeout_s")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: the tiny dense test model")
    parser.add_argument("--work-dir", default="", help="where the runs go (default: a temporary folder)")
    parser.add_argument(
        "--out", default=os.environ.get("OUT", ""), help="folder for the .md/.json (default $OUT)"
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="extra config override"
    )
    args = parser.parse_args()
    placements = [p for p in args.placements.split(",") if p]
    cases = [c for c in args.cases.split(",") if c]
    if set(placements) - {"separate", "colocated"} or set(cases) - {"rollout", "train"}:
        parser.error(f"--placements {args.placements!r} / --cases {args.cases!r}: see --help")
    if not 1 < args.kill_step <= args.steps:
        parser.error(
            f"--kill-step {args.kill_step} must be in 2..--steps ({args.steps}): step k-1's checkpoint"
        )
    if args.tiny:
        args.prompts, args.samples, args.new_tokens, args.lr = 4, 4, 16, 3e-2
        args.case_timeout_s, args.cluster_timeout_s = max(args.case_timeout_s, 600), 300.0

    with tempfile.TemporaryDirectory(dir=args.work_dir or None, prefix="bench_recovery-") as tmp:
        work = Path(tmp)
        (work / "bench_reward.py").write_text(REWARD)
        started = time.time()
        model_dir = write_model(work / "model", tiny=args.tiny)
        print(f"model folder written in {time.time() - started:.1f} s; runs under {work}", flush=True)
        lines = header(args)
        print("\n".join(lines), flush=True)
        rows: list[Row] = []
        for placement in placements:
            base, base_dir = None, work / placement / "none"
            for case in ["none", *cases]:
                row, run_dir = run_case(args, placement, case, model_dir, work)
                if case == "none":
                    base = row
                    set_normal(row, run_dir, args.kill_step)
                else:
                    compare(row, run_dir, base, base_dir, args)
                    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # GBs a run on a GPU
                rows.append(row)
                lines.append(table_line(row))
                print(lines[-1], flush=True)
                save(args.out, lines, rows, work)
        lines += ["", *notes(rows, work)]
        print("\n".join(lines[len(rows) + 2 :]), flush=True)
        save(args.out, lines, rows, work)


if __name__ == "__main__":
    main()
