"""Rollout stage of the loop: prompts -> completions -> scored `Sample`s (with dynamic sampling).

Sampling noise is seeded per request from (run seed, step, prompt position in the data), so a
resumed run draws exactly the completions the uninterrupted run drew.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from rlloom.algorithms import keep_informative_groups, overlong_penalty
from rlloom.cluster.base import RolloutGroup
from rlloom.config import RunConfig
from rlloom.data.control_tokens import ResponseDecoder
from rlloom.data.dataset import PromptItem
from rlloom.data.source import PromptSource
from rlloom.data.types import Sample
from rlloom.engines.rollout import SamplingParams
from rlloom.faults import maybe_fail
from rlloom.rewards.calling import RewardInput
from rlloom.rewards.runner import RewardRunner


def request_seed(run_seed: int, step: int, round_idx: int, position: int) -> int:
    """A per-request seed that depends only on where the request sits in the run."""
    return (run_seed * 1_000_003 + step * 10_007 + round_idx * 101 + position) % (2**31 - 1)


@dataclass(kw_only=True, slots=True)
class RolloutResult:
    samples: list[Sample]
    metrics: dict[str, float]


def generate_samples(
    rollout_group: RolloutGroup,
    items: list[PromptItem],
    sampling: list[SamplingParams],
    *,
    first_group_id: int,
) -> list[Sample]:
    """One completion per sample of each prompt, unscored; samples of prompt i share a group id."""
    completions = rollout_group.generate([it.prompt_ids for it in items], sampling).result()
    samples = []
    for c in completions:
        if c.error is not None:
            raise ValueError(f"rollout rejected prompt {c.prompt_index}: {c.error}")
        item = items[c.prompt_index]
        samples.append(
            Sample(
                prompt_ids=list(item.prompt_ids),
                response_ids=list(c.token_ids),
                rollout_logprobs=list(c.logprobs),
                group_id=first_group_id + c.prompt_index,
                finish_reason=c.finish_reason,
                policy_version=c.policy_version,
                routed_experts=c.routed_experts,
                metadata={
                    "ground_truth": item.ground_truth,
                    "index": item.index,
                    "prompt": item.prompt,
                    "columns": item.metadata,
                },
            )
        )
    return samples


def score_samples(
    samples: list[Sample], runner: RewardRunner, decode: ResponseDecoder, cfg: RunConfig
) -> dict[str, float]:
    """Decode responses (control tokens inside them visible), run the reward function, add overlong
    shaping; fills `Sample.reward` and the metadata's `response_text`, `score` and `control_tokens`."""
    texts = [decode(s.response_ids) for s in samples]
    result = runner.score(
        [
            RewardInput(
                t, s.metadata["ground_truth"], prompt=s.metadata["prompt"], columns=s.metadata["columns"]
            )
            for t, s in zip(texts, samples)
        ]
    )
    scores, metrics = result.scores, result.metrics()
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
        s.metadata["control_tokens"] = decode.num_control(s.response_ids)
        s.reward = score + pen
    return dict(metrics)


def collect_rollouts(
    rollout_group: RolloutGroup,
    source: PromptSource,
    runner: RewardRunner,
    decode: ResponseDecoder,
    cfg: RunConfig,
    *,
    step: int,
    stop_token_ids: list[int],
) -> RolloutResult:
    """prompts_per_step groups of n samples; with dynamic sampling, only groups whose rewards differ,
    drawing more prompts for up to `max_sampling_rounds` rounds."""
    ro, algo = cfg.rollout, cfg.algorithm
    want = cfg.trainer.prompts_per_step
    kept: list[Sample] = []
    metrics: dict[str, float] = {}
    num_groups = num_dropped = 0
    rounds = algo.max_sampling_rounds if algo.dynamic_sampling else 1
    for round_idx in range(rounds):
        missing = want - num_groups
        if missing <= 0:
            break
        items = source.next_batch(missing)
        base = SamplingParams.from_config(ro)
        sampling = [
            dataclasses.replace(
                base, stop_token_ids=stop_token_ids, seed=request_seed(cfg.trainer.seed, step, round_idx, i)
            )
            for i in range(len(items))
        ]
        samples = generate_samples(
            rollout_group, items, sampling, first_group_id=step * 1_000_000 + round_idx * 10_000
        )
        maybe_fail("generate", step)
        for k, v in score_samples(samples, runner, decode, cfg).items():
            metrics[k] = metrics.get(k, 0.0) + v
        maybe_fail("rewards", step)
        if round_idx == 0:
            metrics.update(reward_metrics(samples))
        if algo.dynamic_sampling:
            keep_B = keep_informative_groups(
                torch.tensor([s.reward for s in samples]), torch.tensor([s.group_id for s in samples])
            )
            num_dropped += len(items) - int(keep_B.sum()) // ro.n_samples
            samples = [s for s, k in zip(samples, keep_B.tolist()) if k]
        kept.extend(samples)
        num_groups = len(kept) // ro.n_samples
    kept = kept[: want * ro.n_samples]
    metrics["rollout/groups_dropped"] = float(num_dropped)
    metrics["rollout/groups_kept"] = float(len(kept) // ro.n_samples)
    return RolloutResult(samples=kept, metrics=metrics)


def reward_metrics(samples: list[Sample]) -> dict[str, float]:
    """Reward, accuracy and length statistics of a step's first sampling round, every sample of it
    (under dynamic sampling the groups dropped too: what the policy produced, not what it trained on)."""
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
        # responses holding a control token before their end (the policy wrote chat structure)
        "response/special_token_frac": sum(s.metadata["control_tokens"] > 0 for s in samples) / len(samples),
    }


def trained_reward_metrics(samples: list[Sample]) -> dict[str, float]:
    """`reward/trained_mean`: the mean reward of the samples a step trains on (under dynamic sampling
    the kept groups of every round, unlike `reward_metrics`'s first round; without it the same)."""
    return {"reward/trained_mean": sum(s.reward for s in samples) / len(samples)}
