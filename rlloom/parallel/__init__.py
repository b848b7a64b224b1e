"""Parallelism: `ParallelDims` validates the degrees and builds every named mesh; one function per
technique takes a model and a mesh (`apply_tp`, `apply_ep`, `apply_ac`, `apply_compile`,
`apply_fsdp`); `vocab_parallel_token_logprobs` is the logprob head of a tensor-parallel model;
`clip_grad_norm_` works on sharded and plain gradients alike."""

from rlloom.parallel.ac import apply_ac
from rlloom.parallel.compile import apply_compile
from rlloom.parallel.dims import ParallelDims
from rlloom.parallel.distributed import init_distributed
from rlloom.parallel.ep import apply_ep
from rlloom.parallel.fsdp import apply_fsdp
from rlloom.parallel.grad_norm import clip_grad_norm_, grad_norm
from rlloom.parallel.tp import apply_tp
from rlloom.parallel.vocab_parallel import vocab_parallel_token_logprobs

__all__ = [
    "ParallelDims",
    "apply_ac",
    "apply_compile",
    "apply_ep",
    "apply_fsdp",
    "apply_tp",
    "clip_grad_norm_",
    "grad_norm",
    "init_distributed",
    "vocab_parallel_token_logprobs",
]
