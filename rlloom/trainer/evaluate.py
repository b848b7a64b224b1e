"""Evaluation: greedy (or eval_temperature) answers to the held-out prompts, scored by the task reward."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from rlloom.config.components import RunConfig
from rlloom.data.dataset import PromptItem
from rlloom.engines.rollout.native import SamplingParams
from rlloom.rewards.calling import RewardInput
from rlloom.rewards.runner import RewardRunner


def evaluate(
    group: object,
    items: list[PromptItem],
    runner: RewardRunner,
    decode: Callable[[list[int]], str],
    cfg: RunConfig,
    *,
    stop_token_ids: list[int],
) -> dict[str, float]:
    """`eval/accuracy` (fraction scoring >= 1) and `eval/length_mean` over the held-out prompts."""
    if not items:
        return {}
    base = SamplingParams.from_config(cfg.rollout, evaluation=True)
    sampling = [
        dataclasses.replace(base, stop_token_ids=stop_token_ids, seed=cfg.trainer.seed + i)
        for i in range(len(items))
    ]
    completions = group.generate([it.prompt_ids for it in items], sampling)  # type: ignore[attr-defined]
    texts = [decode(c.token_ids) for c in completions]
    scored = [(t, items[c.prompt_index]) for t, c in zip(texts, completions)]
    scores = runner.score(
        [RewardInput(t, it.ground_truth, prompt=it.prompt, columns=it.metadata) for t, it in scored]
    ).scores
    correct = sum(s >= 1.0 for s in scores)
    return {
        "eval/accuracy": correct / len(items),
        "eval/length_mean": sum(len(c.token_ids) for c in completions) / len(completions),
    }
