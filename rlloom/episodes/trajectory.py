"""`Trajectory`: one multi-turn episode's exact token bookkeeping, and the `Sample`s it becomes.

A trajectory's tokens are the prompt, then each turn's sampled tokens exactly as generated, then the
chat template's rendering of the new messages (the suffix of the re-rendered conversation after the
tokens so far, checked to extend them), and so on; never re-tokenized text. Only sampled tokens have
`loss_mask` 1; observation and template tokens have 0 (and logprob 0.0, which the mask hides).

Where the template does not extend the tokens so far (Qwen3 strips earlier `<think>` blocks), the
next turn starts a new segment whose prompt is the re-rendered conversation
(`rollout.multi_turn_samples`: `trajectory` refuses that, `auto` and `per_turn` split); each segment
becomes one `Sample` of the trajectory's group with the trajectory's reward.

Legend: one segment = prompt_ids + response_ids, with per-response-token mask, logprobs, versions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from rlloom.data.types import FinishReason
from rlloom.episodes.types import Message


@dataclass(kw_only=True, slots=True)
class Segment:
    """Tokens of one sample: a prompt, then turns and observations after it."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routed_experts: torch.Tensor | None = None
    """MoE: the routes of the latest turn's request, which cover every token fed so far."""

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids


@dataclass(kw_only=True, slots=True)
class Trajectory:
    """One episode of one prompt: its conversation, its segments and what the episode counted."""

    messages: list[Message]
    """The conversation so far as chat messages (observations included)."""
    segments: list[Segment]
    env: Any = None
    """The environment handle of `EnvCalls` (the environment and its `state`)."""
    turns: int = 0
    """Generation turns so far."""
    last_turn_ids: list[int] = field(default_factory=list)
    """The latest turn's sampled tokens (the reward function reads their text)."""
    tool_calls: int = 0
    tool_errors: int = 0
    env_error: str | None = None
    """Why the environment failed (the trajectory then ended with reward.default_score)."""
    reward: float | None = None
    """The environment's reward at `done`; None lets the reward function score it."""
    finish_reason: FinishReason = "stop"
    metrics: dict[str, float] = field(default_factory=dict)
    """The environment's metrics, summed over its steps."""
    done: bool = False

    @property
    def current(self) -> Segment:
        return self.segments[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.current.token_ids)

    def add_turn(self, token_ids: list[int], logprobs: list[float], versions: list[int]) -> None:
        """Append one turn's sampled tokens (trained on)."""
        seg = self.current
        seg.response_ids += token_ids
        seg.loss_mask += [1] * len(token_ids)
        seg.logprobs += logprobs
        seg.versions += versions
        self.turns += 1

    def add_observation(self, token_ids: list[int], version: int) -> None:
        """Append template and observation tokens (not trained on)."""
        seg = self.current
        seg.response_ids += token_ids
        seg.loss_mask += [0] * len(token_ids)
        seg.logprobs += [0.0] * len(token_ids)
        seg.versions += [version] * len(token_ids)

    def start_segment(self, prompt_ids: list[int]) -> None:
        """The next turn's prompt is `prompt_ids` (the re-rendered conversation)."""
        self.segments.append(Segment(prompt_ids=list(prompt_ids)))

    def env_tokens(self) -> int:
        """Masked (observation and template) response tokens over all segments."""
        return sum(len(s.loss_mask) - sum(s.loss_mask) for s in self.segments)


def truncate_ids(ids: list[int], limit: int, side: str) -> list[int]:
    """At most `limit` ids: the first ones (`side="right"` cuts the end) or the last ones ("left")."""
    if len(ids) <= limit:
        return ids
    return ids[:limit] if side == "right" else ids[len(ids) - limit :]
