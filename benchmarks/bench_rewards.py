"""Reward throughput inline vs in worker processes: the `number` reward on arithmetic responses.

1000 responses to the demo's prompts (two-digit addition), half right, scored 5 times (median)
inline and in `--workers` worker processes; then 20 calls of 32 responses, the size of one demo
step (8 prompts x 4 samples). Worker start-up (until the first call returns) is reported apart.

    python benchmarks/bench_rewards.py
    python benchmarks/bench_rewards.py --workers 4
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from rlloom.rewards import RewardRunner, get_reward_fn
from rlloom.tasks.arithmetic import arithmetic_prompts


def demo_responses(num: int) -> list[tuple[str, str]]:
    """(response, ground truth) pairs for the demo's prompts; every other one is off by one."""
    raws = arithmetic_prompts(split="train", num_train=num, num_eval=10, num_digits=2, operators="+", seed=0)
    rng = random.Random(0)
    return [(f"The sum is {int(r.ground_truth) + (rng.random() < 0.5)}.", r.ground_truth) for r in raws]


def median_ms(runner: RewardRunner, pairs: list[tuple[str, str]], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        runner.score(pairs)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    pairs = demo_responses(1000)
    print("| mode | start-up ms | 1000 responses, ms | 32 responses (a demo step), ms |")
    print("|---|---|---|---|")
    for workers in (0, args.workers):
        start = time.perf_counter()
        with RewardRunner(get_reward_fn("number"), num_workers=workers, timeout_s=10.0) as runner:
            runner.score(pairs[:2])
            startup = 1e3 * (time.perf_counter() - start)
            full, step = median_ms(runner, pairs, 5), median_ms(runner, pairs[:32], 20)
        mode = "inline" if workers == 0 else f"{workers} workers"
        print(f"| {mode} | {startup:.0f} | {full:.1f} | {step:.2f} |")


if __name__ == "__main__":
    main()
