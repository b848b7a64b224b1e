"""rlloom vs TRL's GRPOTrainer on the same CPU workload: seconds per GRPO step and the reward curve.

Workload (the demo's): SmolLM2-135M-Instruct, two-digit addition, 8 prompts x 4 samples, 32 new
tokens, temperature 1, fp32, lr 1e-5, no reference model, token-mean PPO-clip loss (TRL's default
"dapo" loss), reward = the last number in the response equals the sum. TRL runs in its own virtual
environment (it is installed only for this benchmark):

    python3 -m venv .venv-trl && .venv-trl/bin/pip install torch==2.13.0 trl==1.16 gguf accelerate \
        && .venv-trl/bin/pip install --no-deps -e .
    .venv/bin/python benchmarks/trl_peer.py --steps 8 --rounds 2 --trl-python .venv-trl/bin/python

The two run alternately (TRL, rlloom, TRL, rlloom, ...) in fresh processes so that machine noise
hits both; the first step of each run is a warm-up and is left out of the medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPTS, SAMPLES, NEW_TOKENS, LR = 8, 4, 32, 1e-5


def run_trl(steps: int, out: Path) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlloom.config import load_config
    from rlloom.models.checkpoint import resolve_path
    from rlloom.rewards.numbers import number_match
    from rlloom.tasks.build import task_prompts

    torch.manual_seed(0)
    cfg = load_config("arithmetic_demo")
    raws = task_prompts(cfg.data, "train")[: PROMPTS * steps * 2]
    data = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": r.prompt}], "answer": r.ground_truth} for r in raws]
    )

    def reward(completions: list, answer: list, **_: object) -> list[float]:
        return [number_match(c[0]["content"], a) for c, a in zip(completions, answer)]

    path = str(resolve_path("smollm2-135m-instruct"))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    times: list[float] = []
    rewards: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *args: object, **kwargs: object) -> None:
            self.start = time.perf_counter()

        def on_step_end(self, *args: object, **kwargs: object) -> None:
            times.append(time.perf_counter() - self.start)

        def on_log(
            self, args: object, state: object, control: object, logs: dict | None = None, **kw: object
        ) -> None:
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))

    args = GRPOConfig(
        output_dir=str(out.parent / "trl_out"),
        per_device_train_batch_size=PROMPTS * SAMPLES,
        num_generations=SAMPLES,
        max_completion_length=NEW_TOKENS,
        learning_rate=LR,
        lr_scheduler_type="constant",
        beta=0.0,
        temperature=1.0,
        max_steps=steps,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        seed=0,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[Timer()],
    )
    trainer.train()
    out.write_text(json.dumps({"step_s": times, "reward": rewards}))


def run_rlloom(steps: int, out: Path) -> None:
    from rlloom.config import load_config
    from rlloom.trainer.run import run

    with tempfile.TemporaryDirectory() as run_dir:
        cfg = load_config(
            "arithmetic_demo",
            [
                f"trainer.total_steps={steps}",
                "data.num_eval=0",
                f"trainer.run_dir={run_dir}",
                "logging.console=false",
            ],
        )
        run(cfg)
        records = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    steps_ = [r for r in records if "time/step_s" in r]
    out.write_text(
        json.dumps(
            {
                "step_s": [r["time/step_s"] for r in steps_],
                "generate_s": [r["time/generate_s"] for r in steps_],
                "train_s": [r["time/train_s"] for r in steps_],
                "reward": [r["reward/mean"] for r in steps_],
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--trl-python", default=".venv-trl/bin/python")
    parser.add_argument("--side", choices=["trl", "rlloom"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        (run_trl if args.side == "trl" else run_rlloom)(args.steps, Path(args.out))
        return
    results: dict[str, list[dict]] = {"trl": [], "rlloom": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for side, python in (("trl", args.trl_python), ("rlloom", sys.executable)):
                out = Path(tmp) / f"{side}_{r}.json"
                cmd = [python, __file__, "--side", side, "--steps", str(args.steps), "--out", str(out)]
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                results[side].append(json.loads(out.read_text()))
                print(
                    f"round {r} {side}: " + " ".join(f"{t:.1f}" for t in results[side][-1]["step_s"]),
                    flush=True,
                )
    med = {
        side: statistics.median(t for res in runs for t in res["step_s"][1:])
        for side, runs in results.items()
    }
    print(
        f"\n| system | s/step (median, {args.rounds} x {args.steps - 1} steps) | reward per step (round 0) |"
    )
    print("|---|---|---|")
    for side in ("trl", "rlloom"):
        curve = " ".join(f"{x:.2f}" for x in results[side][0]["reward"])
        print(f"| {side} | {med[side]:.2f} | {curve} |")
    gen = statistics.median(t for res in results["rlloom"] for t in res["generate_s"][1:])
    train = statistics.median(t for res in results["rlloom"] for t in res["train_s"][1:])
    print(f"| rlloom split | generate {gen:.2f} s, train {train:.2f} s | |")
    print(f"\nspeed-up rlloom vs TRL: {med['trl'] / med['rlloom']:.2f}x")


if __name__ == "__main__":
    main()
