"""`Ledger`: the exact tokens of one agent session, from its requests to the `Sample`s it trains.

Each answer the session got is a branch: a `Segment` (episodes/trajectory.py) holding the prompt the
engine read and, after it, every sampled token (loss mask 1, with its logprob and weight version)
and every token the session added between requests (the chat template's and the tool or user
messages' tokens: mask 0). A new request is matched against the branches, newest first: when its
rendered conversation starts with a branch's text, only the suffix after it is tokenized (checked
to extend it, `episodes.render.extension_ids`) and the answer continues that branch; otherwise
(a sub-agent, a rewritten history, or `rollout.multi_turn_samples=per_turn`) it starts a branch of
its own from the whole prompt. At the end every branch no later request continued is one sample
of the trajectory's group.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from rlloom.episodes.render import Rendered, encode, extension_ids
from rlloom.episodes.trajectory import Segment
from rlloom.episodes.types import Message


@dataclass(kw_only=True, slots=True)
class Branch:
    """One sample in the making: its tokens and the conversation they hold."""

    segment: Segment
    messages: list[Message]
    """The request's messages and the answer (chat), for samples.jsonl."""
    answer_ids: list[int]
    """The last answer's sampled ids (the reward function reads their text)."""
    finish_reason: str
    continued: bool = False
    """A later request extended it: its tokens live on in that branch."""


@dataclass(frozen=True, slots=True)
class Fork:
    """Where one request's generation starts."""

    prompt_ids: list[int]
    """Everything the engine reads: the parent's tokens and `added`, or the whole prompt."""
    parent: Branch | None = None
    added: list[int] = field(default_factory=list)
    """Ids after the parent's tokens (template and new messages' tokens: not trained on)."""


@dataclass(kw_only=True, slots=True)
class Ledger:
    tokenizer: Any
    extend: bool = True
    """Continue branches (False: `rollout.multi_turn_samples=per_turn`, every request a sample)."""
    branches: list[Branch] = field(default_factory=list)
    requests: int = 0
    """Generation requests answered (`rollout/turns_mean`)."""
    last: Branch | None = None
    """The branch of the latest answer (its text is the session's final answer)."""

    def fork(self, prompt: Rendered | list[int]) -> Fork:
        """The request's prompt ids: an earlier branch's tokens and the new suffix when its prompt
        extends that branch, else the whole prompt tokenized."""
        if self.extend:
            for branch in reversed(self.branches):
                so_far = branch.segment.token_ids
                if isinstance(prompt, list):
                    if prompt[: len(so_far)] == so_far:
                        return Fork(prompt_ids=list(prompt), parent=branch, added=prompt[len(so_far) :])
                    continue
                added = extension_ids(self.tokenizer, so_far, prompt)
                if added is not None:
                    return Fork(prompt_ids=so_far + added, parent=branch, added=added)
        ids = list(prompt) if isinstance(prompt, list) else encode(self.tokenizer, prompt)
        return Fork(prompt_ids=ids)

    def record(
        self,
        fork: Fork,
        token_ids: list[int],
        logprobs: list[float],
        versions: list[int],
        *,
        finish_reason: str,
        messages: list[Message],
        routed_experts: torch.Tensor | None,
    ) -> None:
        """One answer to a request that started at `fork`: a new branch (the parent's tokens, the
        added ones masked, then the sampled ones)."""
        if fork.parent is None:
            seg = Segment(prompt_ids=list(fork.prompt_ids))
        else:
            parent = fork.parent.segment
            parent_version = parent.versions[-1] if parent.versions else versions[0]
            seg = dataclasses.replace(
                parent,
                response_ids=parent.response_ids + fork.added,
                loss_mask=parent.loss_mask + [0] * len(fork.added),
                logprobs=parent.logprobs + [0.0] * len(fork.added),
                versions=parent.versions + [parent_version] * len(fork.added),
            )
            fork.parent.continued = True
        seg.response_ids = seg.response_ids + token_ids
        seg.loss_mask = seg.loss_mask + [1] * len(token_ids)
        seg.logprobs = seg.logprobs + list(logprobs)
        seg.versions = seg.versions + list(versions)
        # The routes cover every token fed to the model: the prompt and the kept tokens but the last.
        seg.routed_experts = None if routed_experts is None else routed_experts[: len(seg.token_ids) - 1]
        branch = Branch(
            segment=seg, messages=messages, answer_ids=list(token_ids), finish_reason=finish_reason
        )
        self.branches.append(branch)
        self.last = branch

    def leaves(self) -> list[Branch]:
        """The branches that become samples (those no later request continued), oldest first."""
        return [b for b in self.branches if not b.continued]
