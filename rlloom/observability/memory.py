"""Peak memory of this process, in GiB (2**30 bytes), as `memory/*` metrics.

On a CUDA device the peak is what the PyTorch caching allocator handed out
(`max_memory_allocated`) and what it held from the driver (`max_memory_reserved`) since the last
`reset_peak_memory`. On CPU it is the peak resident set size of the process from `getrusage`, which
the OS never resets, so it is the peak since the process started.
"""

from __future__ import annotations

import sys

import torch

from rlloom.observability.metrics import Max

_GIB = float(1 << 30)


def _is_cuda(device: torch.device | str | None) -> bool:
    if device is None:
        return torch.cuda.is_available() and torch.cuda.is_initialized()
    return torch.device(device).type == "cuda"


def peak_rss_gib() -> float:
    """Peak resident set size of this process in GiB; 0.0 where `resource` is missing (Windows)."""
    try:
        import resource
    except ImportError:
        return 0.0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is in kilobytes on Linux and in bytes on macOS.
    bytes_ = peak if sys.platform == "darwin" else peak * 1024
    return bytes_ / _GIB


def peak_memory_gib(device: torch.device | str | None = None) -> float:
    """Peak allocated CUDA memory on `device` in GiB, or the process's peak RSS off CUDA.

    `device=None` means the current CUDA device when CUDA is in use, else the CPU.
    """
    if _is_cuda(device):
        return torch.cuda.max_memory_allocated(device) / _GIB
    return peak_rss_gib()


def reset_peak_memory(device: torch.device | str | None = None) -> None:
    """Restart the CUDA peak counters (e.g. each step); a no-op on CPU, where RSS peaks cannot reset."""
    if _is_cuda(device):
        torch.cuda.reset_peak_memory_stats(device)


def memory_metrics(device: torch.device | str | None = None) -> dict[str, Max]:
    """Peak memory as Max metrics (across ranks the interesting number is the largest).

    Keys: `memory/peak_rss_gib` always; `memory/peak_allocated_gib` and `memory/peak_reserved_gib`
    on CUDA.
    """
    out = {"memory/peak_rss_gib": Max(peak_rss_gib())}
    if _is_cuda(device):
        out["memory/peak_allocated_gib"] = Max(torch.cuda.max_memory_allocated(device) / _GIB)
        out["memory/peak_reserved_gib"] = Max(torch.cuda.max_memory_reserved(device) / _GIB)
    return out
