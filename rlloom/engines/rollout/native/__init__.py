"""The native rollout engine: continuous batching, paged KV cache with prefix sharing, CUDA graphs.

Files, in the order a step uses them: engine.py (API and step loop), scheduler.py (who runs),
block_manager.py (KV blocks and reference counts), model_runner.py (inputs, forward, logits),
attention.py (the paged attention backend), paged_decode.py (its Triton decode kernel, CUDA),
cuda_graphs.py (captured decode), sampler.py (tokens and logprobs), in_flight.py (the step whose
tokens are on their way to the host), validation.py (rejected requests, the KV cache's size) and
sequence.py (the in-flight record). With rollout.tp > 1, tensor_parallel.py shards the
model (the layers in tp_layers.py) and vocab_parallel.py samples from the vocabulary slices. The records it returns and the interface it
implements are in ../base.py.
"""

from rlloom.engines.rollout.base import Completion, SamplingParams
from rlloom.engines.rollout.native.engine import NativeEngine

__all__ = ["Completion", "NativeEngine", "SamplingParams"]
