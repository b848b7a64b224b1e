"""Which device and compute dtype a run uses, and host-to-device copies that do not stall the GPU.

A plain `cpu_tensor.to("cuda")` from pageable memory synchronises the stream: the host waits for
every kernel already queued before it can go on, so a loop that copies its next inputs drains the
GPU each time. Copies from pinned memory with `non_blocking=True` only queue the transfer; torch's
caching host allocator keeps the pinned buffer alive until the copy has run.
"""

from __future__ import annotations

import os

import torch

from rlloom.config import RunConfig


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`t` on `device`; CPU -> CUDA goes through pinned memory without a host sync."""
    device = torch.device(device)
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def resolve_device(cfg: RunConfig, local_rank: int = 0) -> torch.device:
    """The device engines run on: cuda:local_rank when available (or asked for), else cpu."""
    want = cfg.cluster.device
    if want == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "cluster.device='cuda' but no CUDA device is visible. Fix: set cluster.device=auto or cpu."
        )
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def resolve_dtype(cfg: RunConfig, device: torch.device) -> torch.dtype:
    if cfg.model.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.model.dtype]


def available_memory_bytes(device: torch.device) -> int:
    """Memory free for a new allocation: the GPU's free memory, or the host's MemAvailable (Linux;
    the physical memory elsewhere)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
