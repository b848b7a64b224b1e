"""Where each millisecond of a GRPO step goes (issue 48: profile before speed work), in one table.

Runs bench_e2e.py's T1 workload (random Qwen3-0.6B weights, 64 prompts x 8 samples, 128 prompt + 512
new tokens, one GPU, inline) for `--steps` steps and profiles the last one with torch.profiler. The
benchmark labels the step's parts with `record_function` ranges around the functions that do them
(no change to rlloom): each stage of the step (rl_step's StageTimer stages: generate, old_logprobs,
train, sync, ...), and inside them the rollout's prefill and decode forwards and its sampler, the
training engine's forwards, backward passes and optimizer step (gradient clipping and the finite
guard included). One table, per part: wall milliseconds (a stage's from the step's own timer,
which synchronizes the device; a part's is host time inside its range, so for the asynchronous
parts that is launch time) and the GPU kernel milliseconds launched inside it; each stage's GPU
idle time (wall minus its kernels: host gaps); the top kernels by GPU time; the GPU idle fraction of
the whole step; and, as the reference, the median step without the profiler (steps 2..N-1).

On the CPU (`--tiny`: the bench_e2e smoke shape) there are no kernels: the parts' host times, and the
top operators by CPU time in place of the kernels.

    python benchmarks/profile_step.py                     # one GPU: the T1 step
    python benchmarks/profile_step.py --set trainer.deterministic=true   # a mode's step
    python benchmarks/profile_step.py --tiny --steps 2     # CPU smoke run
    python benchmarks/profile_step.py --trace /tmp/step.json   # also a chrome trace
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch._C._profiler import _ExperimentalConfig
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).parent))
from bench_e2e import add_shape_args, e2e_config, e2e_context, tiny_shape, write_random_qwen3  # noqa: E402

import rlloom.engines.train.native.engine as train_engine_module  # noqa: E402
from rlloom.cluster.build import build_groups  # noqa: E402
from rlloom.engines.rollout.native.model_runner import ModelRunner  # noqa: E402
from rlloom.engines.rollout.native.sampler import Sampler  # noqa: E402
from rlloom.engines.train.native.runner import MicroBatchRunner  # noqa: E402
from rlloom.observability.timers import StageTimer  # noqa: E402
from rlloom.trainer.step import rl_step  # noqa: E402

STAGE = "stage/"
ROLLOUT_PARTS = ("prefill forward", "decode forward", "sampling")
"""Parts of `generate` (the rollout engine steps in a thread of its own, rlloom/workers/stream.py)."""
PARTS = (*ROLLOUT_PARTS, "forward", "backward", "optimizer")
"""The labelled parts, the training engine's shown under the stage they ran in (`forward` under
old_logprobs is the logprob recompute; under train, the training forward)."""


def labelled(fn: Callable, label: Callable[..., str] | str) -> Callable:
    """fn inside record_function(label) (or label(*args) when label is a function)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        with record_function(label if isinstance(label, str) else label(*args, **kwargs)):
            return fn(*args, **kwargs)

    return wrapper


@contextlib.contextmanager
def labels() -> Iterator[None]:
    """Label the step's stages and parts for the profiler (undone on exit)."""
    timer_call = StageTimer.__call__

    @contextlib.contextmanager
    def staged(self: StageTimer, stage: str) -> Iterator[None]:
        with record_function(STAGE + stage), timer_call(self, stage):
            yield

    patches = [
        (StageTimer, "__call__", staged),
        (ModelRunner, "run", labelled(ModelRunner.run, lambda self, seqs, is_prefill, *a, **k: PARTS[0 if is_prefill else 1])),
        (Sampler, "__call__", labelled(Sampler.__call__, "sampling")),
        (MicroBatchRunner, "run", labelled(MicroBatchRunner.run, "forward")),
        (torch.Tensor, "backward", labelled(torch.Tensor.backward, "backward")),
        (train_engine_module, "clip_grads", labelled(train_engine_module.clip_grads, "optimizer")),
        (train_engine_module, "step_if_finite", labelled(train_engine_module.step_if_finite, "optimizer")),
    ]  # fmt: skip
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, new in patches:
        setattr(owner, name, new)
    try:
        yield
    finally:
        for owner, name, old in saved:
            setattr(owner, name, old)


def stage_of(event) -> str | None:  # noqa: ANN001
    """The stage range an event ran in (its nearest `stage/` ancestor), or None."""
    parent = event.cpu_parent
    while parent is not None and not parent.name.startswith(STAGE):
        parent = parent.cpu_parent
    return None if parent is None else parent.name.removeprefix(STAGE)


def part_times(events: list) -> dict[tuple[str, str], list[float]]:  # noqa: ANN001
    """(stage, part) -> [host ms, GPU kernel ms launched inside] summed over the step; part "" is
    the stage's own range."""
    out: dict[tuple[str, str], list[float]] = {}
    for e in events:
        if e.device_type != DeviceType.CPU:
            continue
        if e.name.startswith(STAGE):  # a stage timed inside another (train_step in train) is its part
            outer = stage_of(e)
            key = (outer, e.name.removeprefix(STAGE)) if outer else (e.name.removeprefix(STAGE), "")
        elif e.name in ROLLOUT_PARTS:
            key = ("generate", e.name)
        elif e.name in PARTS:
            key = (stage_of(e) or "outside stages", e.name)
        else:
            continue
        acc = out.setdefault(key, [0.0, 0.0])
        acc[0] += e.cpu_time_total / 1e3
        acc[1] += e.device_time_total / 1e3
    return out


def is_annotation(name: str) -> bool:
    """The GPU-side copies of annotation ranges (ours, the optimizer's) are not kernels."""
    return name in PARTS or name.startswith((STAGE, "Optimizer."))


def kernel_intervals(events: list) -> list[tuple[float, float]]:  # noqa: ANN001
    """(start, end) in us of every kernel and device copy of the step, sorted by start: by their GPU
    timestamps, so the kernels of a CUDA graph replay and of the autograd engine's thread count too
    (neither is a child of the CPU range that caused it)."""
    spans = [
        (e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type != DeviceType.CPU and not is_annotation(e.name)
    ]
    return sorted(spans)


def busy_ms(spans: list[tuple[float, float]], lo: float, hi: float) -> float:
    """ms of [lo, hi] (us) during which at least one of the sorted `spans` runs (overlaps once)."""
    busy, end = 0.0, lo
    for start, stop in spans:
        start, stop = max(start, end), min(stop, hi)
        if stop > start:
            busy += stop - start
            end = stop
    return busy / 1e3


def stage_busy_ms(events: list, spans: list[tuple[float, float]]) -> dict[str, float]:  # noqa: ANN001
    """stage -> ms the GPU was busy inside the stage's range(s) (the stage timer syncs the device at
    its end, so a stage's kernels run inside its range)."""
    out: dict[str, float] = {}
    for e in events:
        if e.device_type == DeviceType.CPU and e.name.startswith(STAGE):
            stage = e.name.removeprefix(STAGE)
            out[stage] = out.get(stage, 0.0) + busy_ms(spans, e.time_range.start, e.time_range.end)
    return out


def top_ops(prof: profile, on_gpu: bool, n: int = 12) -> list[tuple[str, float]]:
    """The n kernels with the most GPU time (on the CPU: operators by self CPU time), ms."""
    if on_gpu:  # the device-side copies of annotation ranges (ours, the optimizer's) are not kernels
        rows = [
            (e.key, e.self_device_time_total / 1e3)
            for e in prof.key_averages()
            if e.device_type != DeviceType.CPU and not is_annotation(e.key)
        ]
    else:
        rows = [
            (e.key, e.self_cpu_time_total / 1e3)
            for e in prof.key_averages()
            if e.key not in PARTS and not e.key.startswith(STAGE)
        ]
    return sorted(rows, key=lambda r: -r[1])[:n]


def print_table(
    metrics: dict, times: dict, busy: dict, top: list, kernel_ms: float, on_gpu: bool, steady_s: float
) -> None:
    """The one table: stages (wall from the step's timer; GPU ms: busy time inside the stage, by the
    kernels' own timestamps), their parts (host ms inside the part's calls; GPU ms: the kernels
    launched from them, without CUDA graph replays' and the backward thread's), the top kernels,
    idle. Share of step: a stage's wall time; a part's GPU time (host time on the CPU)."""
    step_ms = metrics["time/step_s"] * 1e3
    print(f"\n| part ({'GPU' if on_gpu else 'CPU: no kernels'}) | wall ms | GPU kernel ms | share of step |")
    print("|---|---|---|---|")
    stages = [k.removeprefix("time/").removesuffix("_s") for k in metrics if k.startswith("time/")]
    for stage in [s for s in stages if (s, "") in times]:
        wall = metrics[f"time/{stage}_s"] * 1e3
        gpu = busy.get(stage, 0.0)
        print(f"| {stage} | {wall:.1f} | {gpu:.1f} | {wall / step_ms:.3f} |")
        for (s, part), (host, gpu_part) in sorted(times.items()):
            if s == stage and part:
                share = (gpu_part if on_gpu else host) / step_ms
                print(f"| &nbsp;&nbsp;{stage}: {part} (host) | {host:.1f} | {gpu_part:.1f} | {share:.3f} |")
        if on_gpu:
            print(
                f"| &nbsp;&nbsp;{stage}: GPU idle (host gaps) | {wall - gpu:.1f} | | {(wall - gpu) / step_ms:.3f} |"
            )
    for (s, part), (host, gpu_part) in sorted(times.items()):
        if s == "outside stages":
            print(f"| {part} outside the stages | {host:.1f} | {gpu_part:.1f} | |")
    print(f"| step (profiled) | {step_ms:.1f} | {kernel_ms:.1f} | 1.000 |")
    steady = f"{steady_s * 1e3:.1f}" if steady_s == steady_s else "n/a (needs --steps >= 3)"
    print(f"| step without the profiler (median of the steps before, first left out) | {steady} | | |")
    for name, ms in top:
        print(f"| {'kernel' if on_gpu else 'op (self CPU)'}: {name[:90]} | | {ms:.1f} | {ms / step_ms:.3f} |")
    idle = f"{1 - kernel_ms / step_ms:.3f}" if on_gpu else "n/a (CPU)"
    print(f"| GPU idle fraction of the step | | | {idle} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="steps; the last one is profiled")
    add_shape_args(parser)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    parser.add_argument("--trace", default="", help="also write a chrome trace of the profiled step here")
    args = parser.parse_args()
    if args.tiny:
        tiny_shape(args)
    on_gpu = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_random_qwen3(Path(tmp) / "model", tiny=args.tiny)
        cfg = e2e_config(args, model_dir, Path(tmp) / "run", args.set)
        groups = build_groups(cfg)
        ctx = e2e_context(cfg, groups, args)
        records = []
        for step in range(args.steps - 1):
            records.append(rl_step(ctx, step))
            if step == 0:
                groups.freeze_heap()  # as the run loop does (rlloom/heap.py)
            print(f"step {step}: {records[-1]['time/step_s']:.2f} s", flush=True)
        # All threads: the rollout engine steps in a thread of its own.
        every_thread = _ExperimentalConfig(profile_all_threads=True)
        with labels(), profile(activities=activities, experimental_config=every_thread) as prof:
            metrics = rl_step(ctx, args.steps - 1)
        groups.close()
    events = prof.events()
    spans = kernel_intervals(events)
    kernel_ms = busy_ms(spans, float("-inf"), float("inf"))
    steady = [r["time/step_s"] for r in records[1:]] or [float("nan")]
    print(f"\nprofile_step ({torch.cuda.get_device_name() if on_gpu else 'CPU'}, {args.prompts} prompts x "
          f"{args.samples}, {args.prompt_tokens}+{args.new_tokens} tokens, step {args.steps - 1} profiled)")  # fmt: skip
    print_table(
        metrics,
        part_times(events),
        stage_busy_ms(events, spans),
        top_ops(prof, on_gpu),
        kernel_ms,
        on_gpu,
        statistics.median(steady),
    )
    if args.trace:
        prof.export_chrome_trace(args.trace)


if __name__ == "__main__":
    main()
