"""Process-group start-up: join the job described by torchrun-style environment variables, or start
a one-rank group when there are none (a single GPU still needs a group for FSDP's mixed precision).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

# Tensor-to-tensor collectives under both spellings: torch 2.13 renamed them (`*_single`) and
# deprecates the old names, which torch 2.11 (the GPU machines' version) has alone.
all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def default_backend(device_type: str) -> str:
    """nccl for CUDA, gloo for CPU."""
    return "nccl" if device_type == "cuda" else "gloo"


def init_distributed(device_type: str) -> tuple[int, int]:
    """Initialise the default process group once; returns (rank, world_size).

    With RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set (torchrun, Ray workers) the group joins
    that job; without them it is a one-rank group over an in-memory store, so nothing listens on a
    port. On CUDA the current device becomes LOCAL_RANK when it is set.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    backend = default_backend(device_type)
    if device_type == "cuda" and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()
