"""Host-to-device copies that do not stall the GPU.

A plain `cpu_tensor.to("cuda")` from pageable memory synchronises the stream: the host waits for
every kernel already queued before it can go on, so a loop that copies its next inputs drains the
GPU each time. Copies from pinned memory with `non_blocking=True` only queue the transfer; torch's
caching host allocator keeps the pinned buffer alive until the copy has run.
"""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`t` on `device`; CPU -> CUDA goes through pinned memory without a host sync."""
    device = torch.device(device)
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
