"""The native rollout engine: continuous batching, paged KV cache with prefix sharing, CUDA graphs.

Files, in the order a step uses them: engine.py (API and step loop), scheduler.py (who runs),
block_manager.py (KV blocks and reference counts), model_runner.py (inputs, forward, logits),
attention.py (the paged attention backend), paged_decode.py (its Triton decode kernel, CUDA),
cuda_graphs.py (captured decode), sampler.py (tokens and logprobs), validation.py (rejected
requests), sampling_params.py and sequence.py (records).
"""

from rlloom.engines.rollout.native.engine import NativeEngine
from rlloom.engines.rollout.native.sampling_params import SamplingParams
from rlloom.engines.rollout.native.sequence import Completion

__all__ = ["Completion", "NativeEngine", "SamplingParams"]
