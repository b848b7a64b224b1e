"""Rollout engines: generate completions with per-token logprobs, update weights in place, sleep/wake.

`native` runs rlloom's own model code; adapters for vLLM and SGLang come later behind the same
methods (`generate`, `update_weights`, `sleep`, `wake`, `abort`).
"""

from rlloom.engines.rollout.native import Completion, NativeEngine, SamplingParams

__all__ = ["Completion", "NativeEngine", "SamplingParams"]
