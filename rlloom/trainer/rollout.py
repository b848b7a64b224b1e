"""Scoring of the rollout's samples (the reward function, overlong shaping) and the step's reward
metrics; the seed of each request. Generation itself is the rollout stream's (rollout_stream.py),
the one path for every `trainer.mode`.

Sampling noise is seeded per request from (run seed, step, prompt position in the data), so a
resumed run draws exactly the completions the uninterrupted run drew.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlloom.algorithms import overlong_penalty
from rlloom.config import RunConfig
from rlloom.data.control_tokens import ResponseDecoder
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
    samples: list[Sample], runner: RewardRunner, decode: ResponseDecoder, cfg: RunConfig
) -> dict[str, float]:
    """Decode responses (control tokens inside them visible), run the reward function, add overlong
    shaping; fills `Sample.reward` and the metadata's `response_text`, `score` and `control_tokens`
    (with a reward model, `model_score`: its score before its weight in reward.name).

    A multi-turn sample is scored on its last turn (`metadata["answer_ids"]`), and only when its
    environment gave no reward (`metadata["env_reward"]`)."""
    answers = [s.metadata.get("answer_ids", s.response_ids) for s in samples]
    texts = [decode(ids) for ids in answers]
    given = [s.metadata.get("env_reward") for s in samples]
    todo = [i for i, g in enumerate(given) if g is None]
    result = runner.score(
        [
            RewardInput(
                texts[i],
                samples[i].metadata["ground_truth"],
                prompt=samples[i].metadata["prompt"],
                columns=samples[i].metadata["columns"],
                conversation=decode.conversation(samples[i].prompt_ids, samples[i].response_ids)
                if runner.model is not None
                else "",
            )
            for i in todo
        ]
    )
    if result.model_scores is not None:  # `reward/model_mean` reads them (`reward_metrics`)
        for i, score in zip(todo, result.model_scores):
            samples[i].metadata["model_score"] = score
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
    for s, ids, text, score, pen in zip(samples, answers, texts, scores, penalty_B.tolist()):
        s.metadata["response_text"] = text
        s.metadata["score"] = score
        s.metadata["control_tokens"] = decode.num_control(ids)
        s.reward = score + pen
    return dict(metrics)


def reward_metrics(samples: list[Sample]) -> dict[str, float]:
    """Reward, accuracy and length statistics of a step's first sampling round, every sample of it
    (under dynamic sampling the groups dropped too: what the policy produced, not what it trained on)."""
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    scores = torch.tensor([s.metadata["score"] for s in samples], dtype=torch.float64)
    lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float64)
    model = torch.tensor([s.metadata["model_score"] for s in samples if "model_score" in s.metadata])
    # the reward model's mean score (its samples that scored; before its weight in reward.name)
    model_mean = (
        {"reward/model_mean": float(model[model.isfinite()].double().mean())} if model.numel() else {}
    )
    return {
        **model_mean,
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std(unbiased=False)),
        "train/accuracy": float((scores >= 1.0).double().mean()),
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "response/clip_frac": sum(s.finish_reason == "length" for s in samples) / len(samples),
        # responses holding a control token before their end (the policy wrote chat structure)
        "response/special_token_frac": sum(s.metadata["control_tokens"] > 0 for s in samples) / len(samples),
    }


def trained_reward_metrics(samples: list[Sample]) -> dict[str, float]:
    """`reward/trained_mean`: the mean reward of the samples a step trains on (under dynamic sampling
    the kept groups of every round, unlike `reward_metrics`'s first round; without it the same)."""
    return {"reward/trained_mean": sum(s.reward for s in samples) / len(samples)}
