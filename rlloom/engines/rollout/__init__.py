"""Rollout engines: generate completions with per-token logprobs, update weights in place, sleep/wake.

base.py is the interface (`RolloutEngine`) and its records (`SamplingParams`, `Completion`);
build.py picks the backend; `native/` runs rlloom's own model code. Adapters for vLLM or SGLang
would implement `RolloutEngine` beside it.
"""

from rlloom.engines.rollout.base import Completion, Partial, RolloutEngine, SamplingParams

__all__ = ["Completion", "Partial", "RolloutEngine", "SamplingParams"]
