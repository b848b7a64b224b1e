"""FP8 expert products (`rlloom.models.fp8.fp8_linear`, the rollout's `rollout.quantization=fp8`)
against the bf16 grouped products they replace, at decode and prefill row counts (one table).

Rows: the experts' gate+up and down products of the Qwen3-30B-A3B and DeepSeek-V3 widths, the rows
spread evenly over the experts as a decode batch spreads them. Columns: ms per call (replayed from
a CUDA graph, as decode runs them, so without host overhead), the fp8 weights' bytes read per call,
the achieved weight bandwidth of each, and the speed-ups: fp8 over the bf16 products
`torch._grouped_mm` (training's) and `moe.expert_linear` (the rollout's bf16 path: a Triton kernel
at decode row counts, `torch._grouped_mm` above them), same rows.
Every fp8 result is checked against an fp32 product with the dequantized weights before timing.

    python benchmarks/bench_fp8.py          # needs a CUDA GPU of compute capability >= 8.9
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_rollout import copy_bandwidth  # noqa: E402

from rlloom.models.fp8 import dequantize_rows, fp8_linear, quantize_rows
from rlloom.models.moe import expert_linear

# (name, experts, N, K, rows): N output rows of each expert's matrix, K input columns.
SHAPES = [
    ("Qwen3-30B-A3B experts gate+up, decode 128 x 8", 128, 1536, 2048, 1024),
    ("Qwen3-30B-A3B experts down, decode 128 x 8", 128, 2048, 768, 1024),
    ("DeepSeek-V3 experts gate+up, decode 64 x 8", 256, 4096, 7168, 512),
    ("DeepSeek-V3 experts down, decode 64 x 8", 256, 7168, 2048, 512),
    ("Qwen3-30B-A3B experts gate+up, prefill 2048 x 8", 128, 1536, 2048, 16384),
]


def timed(fn, repeats: int = 20) -> float:
    """ms per call of `fn` replayed from a CUDA graph of `repeats` calls (as the rollout's decode
    runs it: no host overhead per call), median of 5 replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / repeats)
    return sorted(times)[2]


def _print(title: str, header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print(f"\n{title}")
    for r in [header, tuple("-" * w for w in widths), *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))


def main() -> None:
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()
    torch.manual_seed(0)
    if not torch.cuda.is_available():
        raise SystemExit("bench_fp8: needs a CUDA GPU")
    table = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, E, N, K, P in SHAPES:
        w = (torch.randn(E, N, K, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
        q, scale = quantize_rows(w)
        x = torch.randn(P, K, device="cuda", generator=g).to(torch.bfloat16)
        offsets = torch.full((E,), P // E, device="cuda").cumsum(0).to(torch.int32)
        got = fp8_linear(x, q, scale, offsets)
        deq = dequantize_rows(q, scale, torch.float32)
        want = torch.cat([x[e * (P // E) : (e + 1) * (P // E)].float() @ deq[e].T for e in range(E)])
        err = float((got.float() - want).norm() / want.norm())
        assert err < 4e-3, (name, err)
        del deq, want
        wt = w.transpose(-2, -1)
        bf16_ms = timed(lambda x=x, wt=wt, offsets=offsets: torch._grouped_mm(x, wt, offs=offsets))
        kernel_ms = timed(lambda x=x, w=w, offsets=offsets: expert_linear(x, w, offsets))
        fp8_ms = timed(lambda x=x, q=q, scale=scale, offsets=offsets: fp8_linear(x, q, scale, offsets))
        fp8_bytes = q.numel() + scale.numel() * 4
        table.append((
            name, f"{bf16_ms:.4f}", f"{kernel_ms:.4f}", f"{fp8_ms:.4f}", f"{bf16_ms / kernel_ms:.2f}x",
            f"{bf16_ms / fp8_ms:.2f}x", f"{kernel_ms / fp8_ms:.2f}x", f"{fp8_bytes / 2**20:.0f}",
            f"{fp8_bytes / fp8_ms / 1e9:.2f}", f"{w.numel() * 2 / bf16_ms / 1e9:.2f}",
            f"{w.numel() * 2 / kernel_ms / 1e9:.2f}", f"{err:.1e}",
        ))  # fmt: skip
        del w, q, scale, x
        torch.cuda.empty_cache()
    bandwidth = copy_bandwidth(torch.device("cuda"))
    header = (
        "product", "grouped_mm ms", "bf16 expert_linear ms", "fp8 ms", "expert_linear / grouped_mm",
        "fp8 / grouped_mm", "fp8 / expert_linear", "fp8 MiB", "fp8 TB/s", "grouped_mm TB/s",
        "expert_linear TB/s", "fp8 rel err",
    )  # fmt: skip
    _print(
        f"bench_fp8 ({torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e12:.2f} TB/s)",
        header,
        table,
    )


if __name__ == "__main__":
    main()
