"""Sequence: the engine's record of one completion in flight (it returns a `Completion`, see ../base.py).

A request with `n` samples becomes `n` sequences. With prefix sharing the first one (the leader)
carries the other n - 1 in `forks` while it waits; its prefill computes the prompt's KV cache once
and the forks then join with block tables pointing at the same blocks (see block_manager.py).

KV invariant: after every step the cache holds the keys/values of all tokens but the last one
(`num_tokens - 1`); the next forward writes the last token's and samples the one after.

Pending tokens: while a step's sampled tokens are still on the device, each of its rows has a
placeholder at the end of `output_ids`, `pending(row)` = -1 - row (negative, so never a real token),
and NaN in `logprobs`. The next step's forward takes such a token from the device (model_runner.py),
so the host never waits for it before launching; `Scheduler.resolve` writes the real values.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from rlloom.data.types import FinishReason
from rlloom.engines.rollout.base import Completion, SamplingParams
from rlloom.engines.rollout.native.vision import VisionPrompt


def pending(row: int) -> int:
    """The placeholder token of row `row` of the step in flight (see the module docstring)."""
    return -1 - row


def take_pending(ids_S: torch.Tensor, pending_R: torch.Tensor) -> torch.Tensor:
    """`ids_S` with each pending token `pending(r)` replaced by `pending_R[r]` (on the device, no sync)."""
    return torch.where(ids_S < 0, pending_R[(-1 - ids_S).clamp_(min=0)], ids_S)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Sequence:
    """Mutable state of one sample while it is generated (identity equality, used in queues)."""

    seq_id: int
    request_id: str
    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    params: SamplingParams
    policy_version: int
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    """Tokens whose keys/values are in the cache."""
    forks: list[Sequence] = field(default_factory=list)
    """Waiting siblings that join when this (leader) sequence is prefilled; empty otherwise."""
    finish_reason: FinishReason | None = None
    error: str | None = None
    route_chunks: list[torch.Tensor] = field(default_factory=list)
    """MoE: the experts used at positions 0, 1, ... in order, as [n, MoE layers, K] chunks on CPU."""
    num_routed: int = 0
    """Positions covered by `route_chunks` (a recomputed prefill after preemption keeps the originals)."""
    vision: VisionPrompt | None = None
    """The prompt's image features and M-RoPE positions (the same object for the request's n samples)."""

    def record_routes(self, start: int, routes: torch.Tensor) -> None:
        """Keep the routes of positions start.. that are not recorded yet."""
        n, skip = routes.shape[0], self.num_routed - start
        if skip <= 0:  # the usual case: nothing recorded twice, no slice
            self.route_chunks.append(routes)
            self.num_routed += n
        elif skip < n:
            self.route_chunks.append(routes[skip:])
            self.num_routed += n - skip

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def group_size(self) -> int:
        """Sequences admitted together with this one: itself plus its pending forks."""
        return 1 + len(self.forks)

    def completion(self) -> Completion:
        assert self.finish_reason is not None
        return Completion(
            request_id=self.request_id,
            prompt_index=self.prompt_index,
            sample_index=self.sample_index,
            token_ids=list(self.output_ids),
            logprobs=list(self.logprobs),
            finish_reason=self.finish_reason,
            policy_version=self.policy_version,
            error=self.error,
            routed_experts=self._routes(),
        )

    def _routes(self) -> torch.Tensor | None:
        fed = self.num_tokens - 1  # every token but the last went through the model
        if not self.route_chunks or self.num_routed < fed:
            assert not self.route_chunks or self.finish_reason == "abort", (
                f"sequence {self.seq_id}: routes for {self.num_routed} of {fed} positions"
            )
            return None
        return torch.cat(self.route_chunks)[:fed]
