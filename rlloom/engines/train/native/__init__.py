"""The native PyTorch training engine: FSDP2 data parallelism, bf16 compute with fp32 master
weights, token-budget micro-batching, CPU optimizer offload, sealed safetensors checkpoints (no pickle)."""

from rlloom.engines.train.base import LossFn
from rlloom.engines.train.native.engine import NativeTrainEngine

__all__ = ["LossFn", "NativeTrainEngine"]
