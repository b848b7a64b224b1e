"""The rollout-engine interface every backend implements (native today; vLLM or SGLang adapters
plug in behind it without touching workers), and the records that cross it: `SamplingParams` (how
the completions of one prompt are drawn) and `Completion` (one sample, with per-token logprobs,
the policy version and, for MoE models, the experts chosen).

SamplingParams semantics (the trainer relies on these):
- `temperature > 0` samples from softmax(logits / temperature), restricted by top-k then top-p.
  The logprob returned for each token is log_softmax(logits / temperature) in fp32, taken BEFORE
  the top-k/top-p truncation (the same quantity `rlloom.models.logprobs.token_logprobs` computes).
- `temperature == 0` is greedy (argmax); its logprob is that of the raw distribution,
  log_softmax(logits), i.e. temperature 1.
Invalid values are not raised at construction: the engine rejects the request that carries them
(finish_reason "abort", `error` set to the message of `problem()`) and the rest of the batch
proceeds, so one bad prompt never costs a whole rollout.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from rlloom.config import RolloutConfig
from rlloom.data.images import ImageInputs
from rlloom.data.types import FinishReason
from rlloom.models.args import ModelArgs


@dataclass(kw_only=True, slots=True)
class SamplingParams:
    """Sampling settings of one prompt. Example: `SamplingParams(n=8, temperature=1.0, max_new_tokens=256)`."""

    n: int = 1
    """Completions drawn for the prompt (the GRPO group size)."""
    temperature: float = 1.0
    """Softmax temperature; 0 is greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p (1.0 = off)."""
    top_k: int = -1
    """Keep only the top_k most likely tokens (-1 = off)."""
    max_new_tokens: int = 64
    """Most tokens generated per completion (also capped by the engine's max_model_len)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Tokens that end a completion besides EOS (they stop it even with ignore_eos)."""
    stop_strings: list[str] = field(default_factory=list)
    """Strings that end a completion once the decoded response contains one; needs the engine's `decode`."""
    seed: int | None = None
    """Per-request seed: sample j of this prompt draws its noise from (seed, j, token position) only, so
    the result does not depend on the batch it ran in, preemption, or prefix sharing. None = engine RNG."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks)."""

    @classmethod
    def from_config(cls, config: RolloutConfig, *, evaluation: bool = False) -> SamplingParams:
        """Training sampling from `RolloutConfig`; with evaluation=True one sample at eval_temperature."""
        return cls(
            n=1 if evaluation else config.n_samples,
            temperature=config.eval_temperature if evaluation else config.temperature,
            top_p=config.top_p,
            top_k=config.top_k,
            max_new_tokens=config.max_new_tokens,
            stop_strings=list(config.stop_strings),
            ignore_eos=config.ignore_eos and not evaluation,
        )

    def problem(self) -> str | None:
        """Why this request must be rejected, or None if it is valid."""
        checks = [
            (self.n >= 1, "n", self.n, "must be >= 1", "ask for at least one completion per prompt"),
            (self.temperature >= 0, "temperature", self.temperature, "must be >= 0", "use 1.0 (0 is greedy)"),
            (
                0 < self.top_p <= 1,
                "top_p",
                self.top_p,
                "must be in (0, 1]",
                "use 1.0 for the full distribution",
            ),
            (self.top_k == -1 or self.top_k >= 1, "top_k", self.top_k, "must be -1 (off) or >= 1", "use -1"),
            (
                self.max_new_tokens >= 1,
                "max_new_tokens",
                self.max_new_tokens,
                "must be >= 1",
                "use a positive length",
            ),
        ]
        for ok, name, value, rule, fix in checks:
            if not ok:
                return f"SamplingParams.{name}={value!r} is invalid: {rule}. Fix: {fix}."
        if any(not s for s in self.stop_strings):
            return "SamplingParams.stop_strings contains an empty string, which would stop at once. Fix: remove it."
        return None


@dataclass(kw_only=True, slots=True)
class Completion:
    """One sample of one prompt. Example: `Completion(request_id="r0", prompt_index=0, sample_index=1,
    token_ids=[5, 9, 2], logprobs=[-0.3, -1.2, -0.1], finish_reason="stop", policy_version=4)`."""

    request_id: str
    """Id given to (or made by) `add_request`; `generate` uses the prompt's index as a string."""
    prompt_index: int
    """Position of the prompt in `generate`'s list (arrival order for `add_request`)."""
    sample_index: int
    """Which of the prompt's `n` samples this is (0..n-1)."""
    token_ids: list[int]
    """Generated tokens (the stop token included when one ended the completion)."""
    logprobs: list[float]
    """Per generated token: log_softmax(logits / T) in fp32 before top-k/top-p (T = 1 when greedy)."""
    finish_reason: FinishReason
    """"stop" (EOS, stop token or stop string), "length" (max_new_tokens or max_model_len) or "abort"."""
    policy_version: int
    """Weight version (`update_weights`) in force when the request was added."""
    error: str | None = None
    """Why the request was rejected or aborted; None for normal completions."""
    routed_experts: torch.Tensor | None = None
    """MoE models: [len(prompt) + len(token_ids) - 1, MoE layers, K] the experts each token fed to
    the model used (uint8, or int16 beyond 256 experts); None for dense models and aborted requests."""


@dataclass(frozen=True, slots=True)
class Partial:
    """The tokens one unfinished sample has so far (`RolloutEngine.partial`): what a streaming
    client is sent while the sample is generated."""

    request_id: str
    sample_index: int
    token_ids: list[int]
    logprobs: list[float]


class RolloutEngine(Protocol):
    """What a rollout worker, its stream (workers/stream.py) and the weight syncs may call on a
    rollout engine (every rank of a tensor-parallel replica calls each method with the same
    arguments). Two ways to generate: `generate` (a batch, to the end) or the step-level API
    (`add_request` / `resume_request`, then `step` until `has_unfinished` is false; `abort` between
    steps), which keeps requests in flight across weight updates."""

    model: torch.nn.Module
    """The model the weights load into (the in-place sync reads it back to verify the copy)."""
    policy_version: int
    """Weight version of the last `update_weights` (0 before the first)."""

    @property
    def full_args(self) -> ModelArgs:
        """The whole model's architecture (a tensor-parallel rank's `model` holds a slice of it)."""
        ...

    def generate(
        self,
        prompts: list[list[int]],
        sampling: list[SamplingParams],
        images: list[ImageInputs | None] | None = None,
    ) -> list[Completion]:
        """Completions of every prompt (n each), in prompt order; rejected requests come back with
        finish_reason "abort" and `error` set. `images`: each prompt's (a vision-language model)."""
        ...

    def add_request(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        *,
        request_id: str | None = None,
        prompt_index: int | None = None,
        images: ImageInputs | None = None,
        first_sample: int = 0,
    ) -> str:
        """Queue `sampling.n` completions of one prompt; returns the request id (made if not given);
        `images`: the prompt's, encoded once for its n samples; `first_sample`: the sample index of
        the first (its seeded noise's; an agent session's lone first request keeps its group's)."""
        ...

    def resume_request(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        *,
        output_ids: list[int],
        logprobs: list[float],
        request_id: str,
        prompt_index: int,
        sample_index: int,
        images: ImageInputs | None = None,
    ) -> str:
        """Continue one aborted sample from its tokens so far under the current weights (its KV cache
        rebuilt by a prefill); the given tokens and logprobs stay as they are."""
        ...

    def step(self) -> list[Completion]:
        """One decode step; the completions finished since the last call."""
        ...

    def has_unfinished(self) -> bool:
        """Whether any request added is not yet out of `step`."""
        ...

    def partial(self, request_ids: Collection[str]) -> list[Partial]:
        """The tokens so far of the unfinished samples of these requests (those of a step not yet
        resolved left out)."""
        ...

    def abort(self, request_ids: Iterable[str]) -> None:
        """End these requests; their completions (tokens so far, "abort") come out of the next `step`."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy (Hugging Face name, tensor) pairs into the engine's weights in place; later requests
        carry `version`. A tensor-parallel rank takes full tensors or its slices."""
        ...

    def weight_shard_slices(self) -> dict[str, tuple[int, int, int] | None]:
        """Hugging Face weight name -> (dim, start, length) of the full tensor this rank holds, or None
        when it holds all of it (what a sync must deliver to this rank)."""
        ...

    def sleep(self, offload_weights: bool = False) -> None:
        """Free the KV cache (and optionally move the weights to CPU) until `wake`."""
        ...

    def wake(self) -> None: ...
