"""The Triton kernel of `fp8.fp8_linear` (rlloom/models/fp8_kernels.py) against an fp32 product
with the dequantized weights: ragged and empty experts, K not a multiple of 128, decode and prefill
row counts. (The fp8 engine's captured decode: test_gpu_paths.py.) Skipped without a GPU of
compute capability >= 8.9."""

from __future__ import annotations

import pytest
import torch

from rlloom.models.fp8 import dequantize_rows, fp8_linear, quantize_rows

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a CUDA GPU with fp8 (compute capability >= 8.9)",
)


def _reference(x, q, scale, counts):
    w = dequantize_rows(q, scale, torch.float32)
    out, start = [], 0
    for e, n in enumerate(counts):
        out.append(x[start : start + n].float() @ w[e].T)
        start += n
    return torch.cat(out)


@pytest.mark.parametrize(
    "counts, N, K",
    [
        ([1], 96, 200),  # one row, a partial scale group
        ([0, 1000, 0, 3, 1, 0, 17, 64], 256, 384),  # skewed, empty experts, several row tiles
        ([40] * 6, 256, 640),  # the middle tile size
        ([8] * 128, 1536, 2048),  # Qwen3-30B-A3B decode: 128 tokens x 8 over 128 experts
        ([2] * 256, 512, 1024),  # DeepSeek-V3 decode shape, narrowed
        ([1024] * 16, 1536, 2048),  # prefill
    ],
)
def test_kernel_matches_the_dequantized_product(counts, N, K):
    g = torch.Generator(device="cuda").manual_seed(0)
    E, P = len(counts), sum(counts)
    # Rows of the weight at very different magnitudes, so a wrong scale index shows.
    w = torch.randn(E, N, K, device="cuda", generator=g) * torch.rand(E, N, 1, device="cuda", generator=g) * 4
    q, scale = quantize_rows(w)
    x = torch.randn(P, K, device="cuda", generator=g).to(torch.bfloat16)
    offsets = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    got = fp8_linear(x, q, scale, offsets)
    want = _reference(x, q, scale, counts)
    assert got.dtype == torch.bfloat16 and got.shape == (P, N)
    err = float((got.float() - want).norm() / want.norm())
    assert err < 4e-3, err
