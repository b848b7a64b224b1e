"""Parallelism: `ParallelDims` builds the device mesh; one function per technique takes a model and
a mesh (`apply_fsdp`, `apply_ac`, `apply_compile`); `clip_grad_norm_` works on sharded and plain gradients alike."""

from rlloom.parallel.ac import apply_ac
from rlloom.parallel.compile import apply_compile
from rlloom.parallel.dims import ParallelDims
from rlloom.parallel.distributed import init_distributed
from rlloom.parallel.fsdp import apply_fsdp
from rlloom.parallel.grad_norm import clip_grad_norm_, grad_norm

__all__ = [
    "ParallelDims",
    "apply_ac",
    "apply_compile",
    "apply_fsdp",
    "clip_grad_norm_",
    "grad_norm",
    "init_distributed",
]
