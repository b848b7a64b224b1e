"""Evaluation: answers to held-out prompts (greedy, or `samples` per prompt at a temperature), scored
by the task reward.

`evaluate` is what a training run logs (`eval/accuracy`, `eval/length_mean`, and `eval/pass@k` with
k > 1 samples); `score_prompts` returns the per-sample scores for `rlloom eval`'s report. A sample
is correct when its reward is >= 1. With k samples per prompt, accuracy is the mean over all
samples (the pass@1 estimate) and pass@k the fraction of prompts with at least one correct sample.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from rlloom.cluster.base import RolloutGroup
from rlloom.config import RunConfig
from rlloom.data.control_tokens import ResponseDecoder
from rlloom.data.dataset import PromptItem
from rlloom.data.images import ImageInputs
from rlloom.engines.rollout import Completion, SamplingParams
from rlloom.rewards.calling import RewardInput
from rlloom.rewards.runner import RewardRunner


@dataclass(kw_only=True, slots=True)
class EvalScores:
    """Scores of k samples for each of P prompts. Example: `EvalScores(scores=[[1.0, 0.0]],
    lengths=[[3, 5]], texts=[["42", "41"]])` (one prompt, two samples, one right)."""

    scores: list[list[float]]
    """[P][k] reward of each sample."""
    lengths: list[list[int]]
    """[P][k] generated tokens of each sample."""
    texts: list[list[str]]
    """[P][k] decoded responses."""

    def metrics(self) -> dict[str, float]:
        """`eval/accuracy`, `eval/length_mean`, and `eval/pass@k` when k > 1 (k = samples per prompt)."""
        if not self.scores:
            return {}
        k = len(self.scores[0])
        flat = [s for row in self.scores for s in row]
        out = {
            "eval/accuracy": sum(s >= 1.0 for s in flat) / len(flat),
            "eval/length_mean": sum(n for row in self.lengths for n in row) / len(flat),
        }
        if k > 1:
            out[f"eval/pass@{k}"] = sum(any(s >= 1.0 for s in row) for row in self.scores) / len(self.scores)
        return out


Generate = Callable[
    [list[list[int]], list[SamplingParams], list[ImageInputs | None] | None], list[Completion]
]


def score_prompts(
    generate: Generate,
    items: list[PromptItem],
    runner: RewardRunner,
    decode: ResponseDecoder,
    cfg: RunConfig,
    *,
    stop_token_ids: list[int],
    samples: int = 1,
) -> EvalScores:
    """Generate `samples` answers per prompt at `rollout.eval_temperature` and score them.

    `generate`: a rollout engine's `generate(prompts, sampling)`, or a rollout group's, waited on.
    Sample j of prompt i
    draws its noise from seed `trainer.seed + i` (so results do not depend on the batch).
    """
    base = dataclasses.replace(SamplingParams.from_config(cfg.rollout, evaluation=True), n=samples)
    sampling = [
        dataclasses.replace(base, stop_token_ids=stop_token_ids, seed=cfg.trainer.seed + i)
        for i in range(len(items))
    ]
    images = [it.images for it in items] if any(it.images is not None for it in items) else None
    completions = generate([it.prompt_ids for it in items], sampling, images)
    completions = sorted(completions, key=lambda c: (c.prompt_index, c.sample_index))
    texts = [decode(c.token_ids) for c in completions]
    scored = [(t, items[c.prompt_index]) for t, c in zip(texts, completions)]
    conversations = [
        decode.conversation(items[c.prompt_index].prompt_ids, c.token_ids) if runner.model is not None else ""
        for c in completions
    ]
    flat = runner.score(
        [
            RewardInput(t, it.ground_truth, prompt=it.prompt, columns=it.metadata, conversation=conv)
            for (t, it), conv in zip(scored, conversations)
        ]
    ).scores
    rows = range(0, len(completions), samples)
    return EvalScores(
        scores=[flat[r : r + samples] for r in rows],
        lengths=[[len(c.token_ids) for c in completions[r : r + samples]] for r in rows],
        texts=[texts[r : r + samples] for r in rows],
    )


def evaluate(
    rollout_group: RolloutGroup,
    items: list[PromptItem],
    runner: RewardRunner,
    decode: ResponseDecoder,
    cfg: RunConfig,
    *,
    stop_token_ids: list[int],
) -> dict[str, float]:
    """A run's evaluation: `eval/accuracy` (fraction scoring >= 1) and `eval/length_mean`."""
    if not items:
        return {}
    generate = lambda prompts, sampling, images: rollout_group.generate(prompts, sampling, images).result()
    return score_prompts(generate, items, runner, decode, cfg, stop_token_ids=stop_token_ids).metrics()
