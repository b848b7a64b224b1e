"""Jobs of the asynchronous loop: the prompts of one training batch and the scored groups they
produced (rollout_stream.py generates them on the replicas' step-level producers).

A job draws its prompts from the prompt source with the seeds the synchronous step would use for
that batch (`request_seed(seed, job index, round, position)`) and the same group ids, so a job
generated under the same weights yields exactly the synchronous step's samples. Each prompt's n
samples are scored together into a group; with dynamic sampling a group whose rewards are all equal
is dropped and the job draws the missing prompts in another round (up to
`algorithm.max_sampling_rounds`, as `collect_rollouts` does).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from rlloom.algorithms import keep_informative_groups
from rlloom.config import RunConfig
from rlloom.data.control_tokens import ResponseDecoder
from rlloom.data.dataset import PromptItem
from rlloom.data.source import Position
from rlloom.data.types import Sample
from rlloom.engines.rollout import Completion, SamplingParams
from rlloom.rewards.runner import RewardRunner
from rlloom.trainer.rollout import request_seed, reward_metrics, score_samples

ROUND_STRIDE = 10_000
"""Group ids and order keys: job index * 1_000_000 + round * ROUND_STRIDE + prompt position."""


@dataclass(kw_only=True, slots=True)
class Job:
    """The prompts of one training batch and the groups they produced so far."""

    index: int
    """Which batch of the run this is (the step whose seeds it uses)."""
    positions: list[Position] = field(default_factory=list)
    """Where in the prompt source each prompt it drew is (to give them back when it is dropped)."""
    rounds: int = 0
    """Generation rounds started (dynamic sampling adds rounds)."""
    outstanding: int = 0
    """Prompts drawn whose groups are not complete yet."""
    groups: list[tuple[int, list[Sample]]] = field(default_factory=list)
    """Scored groups kept, each with its order key (round * ROUND_STRIDE + prompt position)."""
    num_groups_dropped: int = 0
    """Groups dynamic sampling dropped (all rewards equal)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Reward runner metrics summed over the job's groups."""
    first_round: list[Sample] = field(default_factory=list)
    """Every scored sample of round 0, kept or not (the reward metrics' population)."""
    episodes: list[dict[str, Any]] = field(default_factory=list)
    """Multi-turn: what each trajectory of the job counted (turns, tool calls, errors, tokens)."""

    def batch(self, cfg: RunConfig) -> list[Sample]:
        """The samples to train on: those of the first `prompts_per_step` kept groups (dynamic
        sampling's last round may keep more), in the synchronous step's order."""
        ordered = sorted(self.groups, key=lambda g: g[0])[: cfg.trainer.prompts_per_step]
        return [s for _, group in ordered for s in group]

    def missing(self, cfg: RunConfig) -> int:
        return cfg.trainer.prompts_per_step - len(self.groups)

    def needs_round(self, cfg: RunConfig) -> bool:
        """Its rounds are done, it lacks groups and dynamic sampling allows another round."""
        rounds = cfg.algorithm.max_sampling_rounds if cfg.algorithm.dynamic_sampling else 1
        return self.outstanding == 0 and self.missing(cfg) > 0 and self.rounds < rounds

    def is_complete(self, cfg: RunConfig) -> bool:
        return self.outstanding == 0 and not self.needs_round(cfg)

    def rollout_metrics(self) -> dict[str, float]:
        """The synchronous step's rollout metrics for this job."""
        out = dict(self.metrics)
        out.update(reward_metrics(self.first_round))
        out["rollout/groups_dropped"] = float(self.num_groups_dropped)
        out["rollout/groups_kept"] = float(len(self.groups))
        if self.episodes:
            out.update(episode_metrics(self.episodes))
        return out


def episode_metrics(episodes: list[dict[str, Any]]) -> dict[str, float]:
    """rollout/turns_mean, tool_calls_mean, tool_errors (sum), env_errors (sum), env_tokens_mean
    (masked tokens per trajectory), agent_errors (sum; agent runs) and env/<name> (each environment's
    or agent's metric's mean)."""
    n = len(episodes)
    out = {
        "rollout/turns_mean": sum(e["turns"] for e in episodes) / n,
        "rollout/tool_calls_mean": sum(e["tool_calls"] for e in episodes) / n,
        "rollout/tool_errors": float(sum(e["tool_errors"] for e in episodes)),
        "rollout/env_errors": float(sum(e["env_error"] is not None for e in episodes)),
        "rollout/env_tokens_mean": sum(e["env_tokens"] for e in episodes) / n,
    }
    if any("agent_error" in e for e in episodes):
        out["rollout/agent_errors"] = float(sum(e.get("agent_error") is not None for e in episodes))
    names = sorted({k for e in episodes for k in e["env_metrics"]} - {"tool_calls", "tool_errors"})
    for name in names:
        out[f"env/{name}"] = sum(e["env_metrics"].get(name, 0.0) for e in episodes) / n
    return out


def round_sampling(
    cfg: RunConfig, job: Job, num_prompts: int, stop_token_ids: list[int]
) -> list[SamplingParams]:
    """Sampling of each prompt of the job's next round, seeded as the synchronous step seeds it."""
    base = SamplingParams.from_config(cfg.rollout)
    return [
        dataclasses.replace(
            base, stop_token_ids=stop_token_ids, seed=request_seed(cfg.trainer.seed, job.index, job.rounds, i)
        )
        for i in range(num_prompts)
    ]


def group_id(job: Job, round_idx: int, position: int) -> int:
    return job.index * 1_000_000 + round_idx * ROUND_STRIDE + position


def make_sample(item: PromptItem, gid: int, c: Completion, versions: list[int]) -> Sample:
    """A sample from a completion; `versions` is the policy version of each of its tokens."""
    return Sample(
        prompt_ids=list(item.prompt_ids),
        response_ids=list(c.token_ids),
        rollout_logprobs=list(c.logprobs),
        group_id=gid,
        finish_reason=c.finish_reason,
        policy_version=versions[0] if versions else c.policy_version,
        token_versions=versions,
        routed_experts=c.routed_experts,
        images=item.images,
        metadata={
            "ground_truth": item.ground_truth,
            "index": item.index,
            "prompt": item.prompt,
            "columns": item.metadata,
        },
    )


def add_group(
    job: Job,
    group: list[Sample],
    order: int,
    cfg: RunConfig,
    runner: RewardRunner,
    decode: ResponseDecoder,
) -> None:
    """Score one prompt's samples and keep the group (unless dynamic sampling drops it)."""
    for k, v in score_samples(group, runner, decode, cfg).items():
        job.metrics[k] = job.metrics.get(k, 0.0) + v
    if order < ROUND_STRIDE:
        job.first_round.extend(group)
    # One record per trajectory (its segments share one `episode` dict).
    job.episodes.extend(
        {id(s.metadata["episode"]): s.metadata["episode"] for s in group if "episode" in s.metadata}.values()
    )
    informative = True
    if cfg.algorithm.dynamic_sampling:
        keep_B = keep_informative_groups(
            torch.tensor([s.reward for s in group]), torch.tensor([s.group_id for s in group])
        )
        informative = bool(keep_B.all())
    if informative:
        job.groups.append((order, group))
    else:
        job.num_groups_dropped += 1
    job.outstanding -= 1
