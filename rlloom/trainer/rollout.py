"""Scoring of the rollout's samples (the reward function, overlong shaping) and the step's reward
metrics; the seed of each request. Generation itself is the rollout stream's (rollout_stream.py),
the one path for every `trainer.mode`.

Sampling noise is seeded per request from (run seed, step, prompt position in the data), so a
resumed run draws exactly the completions the uninterrupted run drew.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlloom.algorithms import overlong_penalty
from rlloom.config.components import RunConfig
from rlloom.data.types import Sample
from rlloom.rewards.calling import RewardInput
from rlloom.rewards.runner import RewardRunner


def request_seed(run_seed: int, step: int, round_idx: int, position: int) -> int:
    """A per-request seed that depends only on where the request sits in the run."""
    return (run_seed * 1_000_003 + step * 10_007 + round_idx * 101 + position) % (2**31 - 1)


@dataclass(kw_only=True, slots=True)
class RolloutResult:
    samples: list[Sample]
    metrics: dict[str, float]


def score_samples(
    samples: list[Sample], runner: RewardRunner, decode: Callable[[list[int]], str], cfg: RunConfig
) -> dict[str, float]:
    """Decode responses, run the reward function, add overlong shaping; fills `Sample.reward`.

    A multi-turn sample carries its final answer (`metadata["response_text"]`, the last assistant
    message) and, when its environment gave one, its reward (`metadata["env_reward"]`): the reward
    function scores only the samples without one."""
    texts = [s.metadata.get("response_text") or decode(s.response_ids) for s in samples]
    given = [s.metadata.get("env_reward") for s in samples]
    todo = [i for i, g in enumerate(given) if g is None]
    result = runner.score(
        [
            RewardInput(
                texts[i],
                samples[i].metadata["ground_truth"],
                prompt=samples[i].metadata["prompt"],
                columns=samples[i].metadata["columns"],
            )
            for i in todo
        ]
    )
    scores = [float(g) if g is not None else 0.0 for g in given]
    for i, score in zip(todo, result.scores):
        scores[i] = score
    metrics = result.metrics()
    penalty_B = torch.zeros(len(samples))
    algo = cfg.algorithm
    if algo.overlong_buffer > 0:
        lengths_B = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float32)
        penalty_B = overlong_penalty(
            lengths_B,
            max_len=cfg.rollout.max_new_tokens,
            buffer_len=algo.overlong_buffer,
            factor=algo.overlong_factor,
        )
    for s, text, score, pen in zip(samples, texts, scores, penalty_B.tolist()):
        s.metadata["response_text"] = text
        s.metadata["score"] = score
        s.reward = score + pen
    return dict(metrics)


def reward_metrics(samples: list[Sample]) -> dict[str, float]:
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    scores = torch.tensor([s.metadata["score"] for s in samples], dtype=torch.float64)
    lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float64)
    return {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std(unbiased=False)),
        "train/accuracy": float((scores >= 1.0).double().mean()),
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "response/clip_frac": sum(s.finish_reason == "length" for s in samples) / len(samples),
    }
