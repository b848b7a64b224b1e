"""Process-group start-up: join the job described by torchrun-style environment variables, or start
a one-rank group when there are none (a single GPU still needs a group for FSDP's mixed precision).
"""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol

# Tensor-to-tensor collectives under both spellings: torch 2.13 renamed them (`*_single`) and
# deprecates the old names, which torch 2.11 (the GPU machines' version) has alone.
all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
# The differentiable functional all-gather (backward: reduce-scatter, sum), traceable by compile.
all_gather_autograd = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd


_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
_PORTS_GIVEN: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands to outgoing connections (Linux's default 32768-60999)."""
    try:
        low, high = (int(v) for v in _EPHEMERAL.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def free_port(host: str = "") -> int:
    """A TCP port free on `host` now, for a rendezvous store to listen on later.

    It is drawn at random from below the kernel's ephemeral range: a port the kernel handed out
    (binding port 0) could be given again to an outgoing connection, gloo's or a store client's,
    before the store binds it (EADDRINUSE). A port is not handed out twice by one process.
    """
    low, high = _ephemeral_range()
    first, last = (20000, low - 1) if low > 21000 else (high + 1, 65535)
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randint(first, last)
        if port in _PORTS_GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _PORTS_GIVEN.add(port)
        return port
    raise RuntimeError(f"no free TCP port in {first}-{last} on {host or 'this host'} after 200 tries")


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
