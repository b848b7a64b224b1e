"""Peak memory of this process, in GiB (2**30 bytes), as `memory/*` metrics.

On a CUDA device the peak is what the PyTorch caching allocator handed out
(`max_memory_allocated`) and what it held from the driver (`max_memory_reserved`) since the last
`reset_peak_memory`. On CPU it is the peak resident set size of the process from `getrusage`, which
the OS never resets, so it is the peak since the process started.
"""

from __future__ import annotations

import re
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


# ---- what holds memory at the peak (CUDA allocator history) ---------------------------------------

Holder = tuple[str, int]
"""(where the allocation was made: "file:line function", bytes live at the peak)."""


_GENERATED = re.compile(r"/([a-z0-9]{2}/c[a-z0-9]{40,}\.py)$")
"""A file of Python that torch.compile's Inductor generated (in its cache: two-character folder,
"c" + hash), wherever the cache lives (rlloom's is under ~/.cache/rlloom/compile)."""


def _frame(f: dict) -> str:
    return f"{f.get('filename', '?').rsplit('/site-packages/', 1)[-1]}:{f.get('line', 0)} {f.get('name', '')}"


def allocation_site(frames: list[dict]) -> str:
    """Where an allocation was made, innermost frame first: rlloom's own code as
    "rlloom/parallel/cp.py:280 attn"; code torch.compile generated (a compiled layer's forward or
    backward, whose lines name the buffers) as "compiled 3x/c3x...py:739 call"; otherwise torch's
    innermost frame and its caller's function, "torch/.../_fsdp_collectives.py:59 allocate <
    foreach_reduce" (FSDP's gather and reduce buffers come from one line)."""
    for frame in frames:
        name = frame.get("filename", "")
        generated = _GENERATED.search(name)
        if generated:
            return f"compiled {generated.group(1)}:{frame.get('line', 0)} {frame.get('name', '')}"
        if "/rlloom/" in name and "/observability/" not in name:
            return f"rlloom/{name.rsplit('/rlloom/', 1)[1]}:{frame.get('line', 0)} {frame.get('name', '')}"
    if not frames:
        return "(no stack)"
    return _frame(frames[0]) + (f" < {frames[1].get('name', '')}" if len(frames) > 1 else "")


def peak_holders(events: list[dict], top: int = 12) -> tuple[int, list[Holder]]:
    """(peak bytes, the `top` allocation sites by bytes live at the peak) from a CUDA allocator trace
    (`torch.cuda.memory._snapshot()["device_traces"][device]`: alloc / free_completed events).

    Counted from the start of the recording: memory allocated before it (weights, optimizer state)
    is not in the trace, and its frees are ignored. A block counts until `free_completed` (when its
    streams are done with it), as `max_memory_allocated` counts it.
    """
    frees = {"free_completed"} if any(e["action"] == "free_completed" for e in events) else {"free_requested"}
    live: dict[int, int] = {}
    current = peak = 0
    peak_at = -1
    for i, e in enumerate(events):  # first pass: when the peak is
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
            current += e["size"]
            if current > peak:
                peak, peak_at = current, i
        elif e["action"] in frees and e["addr"] in live:
            current -= live.pop(e["addr"])
    holders: dict[int, tuple[int, str]] = {}
    for e in events[: peak_at + 1]:  # second pass: what is live then
        if e["action"] == "alloc":
            holders[e["addr"]] = (e["size"], allocation_site(e.get("frames", [])))
        elif e["action"] in frees:
            holders.pop(e["addr"], None)
    by_site: dict[str, int] = {}
    for size, site in holders.values():
        by_site[site] = by_site.get(site, 0) + size
    return peak, sorted(by_site.items(), key=lambda kv: -kv[1])[:top]


def record_allocations(enabled: bool) -> None:
    """Start (True) or stop (False) recording the CUDA allocator's history with Python stacks."""
    if enabled:
        torch.cuda.memory._record_memory_history(enabled="all", stacks="python", max_entries=2_000_000)
    else:
        torch.cuda.memory._record_memory_history(enabled=None)


def allocation_trace(device: torch.device) -> list[dict]:
    """The recorded alloc/free events of `device` (see `record_allocations`)."""
    traces = torch.cuda.memory._snapshot()["device_traces"]
    return traces[device.index if device.index is not None else torch.cuda.current_device()]
