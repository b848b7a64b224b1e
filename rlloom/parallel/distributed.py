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
import torch.distributed.distributed_c10d as c10d

# Tensor-to-tensor collectives under both spellings: torch 2.13 renamed them (`*_single`) and
# deprecates the old names, which torch 2.11 (the GPU machines' version) has alone.
all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_rows(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's x [n, ...] stacked in rank order [world x n, ...], differentiable: each rank's
    gradient is the sum over ranks of the gradients of its rows (the backward reduce-scatters).

    An opaque custom op around the in-place c10d calls, so that inside a compiled, checkpointed
    decoder layer it is an ordinary op: recomputed in the backward like the layer's other
    activations, its result used there. The two other spellings failed there on torch 2.11 (the GPU
    machines'), where CPU tests cannot see it (layers compile on CUDA only):
    - an autograd.Function around the c10d calls: its backward gave the inputs no gradient at all
      (context parallelism's keys and values, a 64k-token cp=2 step on 2 H200);
    - torch's functional collective (`all_gather_tensor_autograd`): the forward kept the gathered
      rows of every layer for the backward despite activation checkpointing (cp x the local keys
      and values a layer: 8.5 GiB of a 64k-token cp=2 step of Qwen3-8B), and the backward gathered
      them again without ever waiting for it (torch's "wait_tensor() is not invoked" warning):
      a collective per layer wasted, and its output held by c10d until the process exits.
    """
    # The group's size is an argument, not looked up by the fake: compiled code (and torch's on-disk
    # compile cache, keyed by the graph) then tells a cp=4 layer from a cp=2 one of the same group name.
    return _all_gather_rows(x.contiguous(), dist.get_world_size(group), group.group_name)


@torch.library.custom_op("rlloom::all_gather_rows", mutates_args=())
def _all_gather_rows(x: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    group = c10d._resolve_process_group(group_name)
    out = x.new_empty((group_size * x.shape[0], *x.shape[1:]))
    all_gather_tensor(out, x, group=group)
    return out


@_all_gather_rows.register_fake
def _(x: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    return x.new_empty((group_size * x.shape[0], *x.shape[1:]))


@torch.library.custom_op("rlloom::reduce_scatter_rows", mutates_args=())
def _reduce_scatter_rows(x: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    group = c10d._resolve_process_group(group_name)
    out = x.new_empty((x.shape[0] // group_size, *x.shape[1:]))
    reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


@_reduce_scatter_rows.register_fake
def _(x: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    return x.new_empty((x.shape[0] // group_size, *x.shape[1:]))


def _all_gather_rows_context(ctx, inputs: tuple, output: torch.Tensor) -> None:  # noqa: ANN001
    _, ctx.group_size, ctx.group_name = inputs


def _all_gather_rows_backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # noqa: ANN001
    return _reduce_scatter_rows(grad, ctx.group_size, ctx.group_name), None, None


_all_gather_rows.register_autograd(_all_gather_rows_backward, setup_context=_all_gather_rows_context)


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
