"""One on-policy distillation step (algorithm.estimator=opd) on the T1 workload, with a teacher of 4x
the student's parameters: what share of the step the teacher's forward takes.

Workload: bench_e2e.py's T1 (random Qwen3-0.6B student, 64 prompts x 8 samples, 128 prompt tokens,
exactly 512 new tokens, bf16 compute, 32k-token micro-batches, one GPU inline), plus a random teacher
of the same family and vocabulary, 28 layers of width 2048 with an MLP of 10240 (2.42B parameters,
4.06x the student's 0.60B), forward-only on the training rank as the reference model is
(`teacher.path`). The step adds the student's old logprobs (OPD always recomputes them: the
advantage compares them with the teacher's) and the teacher's logprobs to generate, train and sync.
Steps after the first are steady state; the table reports their median and each stage's share.

    python benchmarks/bench_opd.py                  # one GPU
    python benchmarks/bench_opd.py --tiny --steps 2 # CPU: 2-layer toys (teacher ~3.9x)
    python benchmarks/bench_opd.py --set teacher.offload=true   # the teacher waits on the host
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_e2e import add_shape_args, e2e_config, e2e_context, tiny_shape, write_random_qwen3  # noqa: E402

from rlloom.cluster.build import build_groups  # noqa: E402
from rlloom.trainer.step import rl_step  # noqa: E402

STAGES = ("generate", "old_logprobs", "teacher_logprobs", "advantages", "train", "sync")


def write_teacher(path: Path, *, tiny: bool) -> tuple[Path, int]:
    """A random bf16 Qwen3 teacher with the student's vocabulary, about 4x its parameters; (folder,
    parameter count)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    shape = (
        dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=512)
        if tiny
        else dict(hidden_size=2048, intermediate_size=10240, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, vocab_size=151936)
    )  # fmt: skip
    config = Qwen3Config(**shape, max_position_embeddings=4096, tie_word_embeddings=True)
    torch.manual_seed(1)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    return path, sum(p.numel() for p in model.parameters())


def count_params(path: Path) -> int:
    from transformers import AutoModelForCausalLM

    return sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(path).parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    add_shape_args(parser)
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="extra config override"
    )
    args = parser.parse_args()
    if args.tiny:
        tiny_shape(args)

    with tempfile.TemporaryDirectory() as tmp:
        student = write_random_qwen3(Path(tmp) / "student", tiny=args.tiny)
        teacher, teacher_params = write_teacher(Path(tmp) / "teacher", tiny=args.tiny)
        student_params = count_params(student)
        opd = ["algorithm.estimator=opd", f"teacher.path={teacher}", *args.set]
        cfg = e2e_config(args, student, Path(tmp) / "run", opd)
        groups = build_groups(cfg)
        ctx = e2e_context(cfg, groups, args)
        records = []
        for step in range(args.steps):
            m = rl_step(ctx, step)
            if step == 0:
                groups.freeze_heap()
            records.append(m)
            print(
                f"step {step}: {m['time/step_s']:.2f} s (teacher {m['time/teacher_logprobs_s']:.2f}), "
                f"distill/reverse_kl {m['distill/reverse_kl']:.3f}",
                flush=True,
            )
        groups.close()
    steady = records[1:] or records
    step_s = statistics.median(r["time/step_s"] for r in steady)
    print(
        f"\n| stage | median s ({len(steady)} steady steps; student {student_params / 1e6:.4g}M, teacher "
        f"{teacher_params / 1e6:.4g}M = {teacher_params / student_params:.2f}x) | share of the step |"
    )
    print("|---|---|---|")
    for stage in STAGES:
        seconds = statistics.median(r.get(f"time/{stage}_s", 0.0) for r in steady)
        print(f"| {stage} | {seconds:.3f} | {seconds / step_s:.1%} |")
    print(f"| step | {step_s:.3f} | 100% |")
    print(f"| peak memory GiB | {max(r.get('memory/peak_allocated_gib', 0.0) for r in steady):.1f} | |")


if __name__ == "__main__":
    main()
