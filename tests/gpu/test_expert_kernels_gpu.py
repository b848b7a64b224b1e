"""The Triton kernel of the experts' products (rlloom/models/expert_kernels.py) against an fp32
product: with fp8 weights (`fp8.fp8_linear`, the dequantized weights) and bf16 ones
(`moe.expert_linear`); ragged and empty experts, K not a multiple of the block, decode and prefill
row counts. (The engines' captured decode: test_gpu_paths.py.) Skipped without a GPU of compute
capability >= 8.9."""

from __future__ import annotations

import pytest
import torch

from rlloom.models.fp8 import dequantize_rows, fp8_linear, quantize_rows
from rlloom.models.moe import expert_linear

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a CUDA GPU with fp8 (compute capability >= 8.9)",
)


def _reference(x, q, scale, counts):
    w = dequantize_rows(q, scale, torch.float32) if scale is not None else q.float()
    out, start = [], 0
    for e, n in enumerate(counts):
        out.append(x[start : start + n].float() @ w[e].T)
        start += n
    return torch.cat(out)


SHAPES = pytest.mark.parametrize(
    "counts, N, K",
    [
        ([1], 96, 200),  # one row, a partial scale group
        ([0, 1000, 0, 3, 1, 0, 17, 64], 256, 384),  # skewed, empty experts, several row tiles
        ([40] * 6, 256, 640),  # the middle tile size
        ([12, 20, 5, 16, 9, 14, 11, 17] * 4, 512, 1024),  # 9-16 rows an expert, skewed
        ([8] * 128, 1536, 2048),  # Qwen3-30B-A3B decode: 128 tokens x 8 over 128 experts
        ([2] * 256, 512, 1024),  # DeepSeek-V3 decode shape, narrowed
        ([1024] * 16, 1536, 2048),  # prefill
    ],
)


@SHAPES
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


def _skewed(E, rows, g):
    """Uniformly random routing of E * rows picks (the busiest expert gets about twice the mean)."""
    ids = torch.randint(0, E, (E * rows,), device="cuda", generator=g)
    return torch.bincount(ids, minlength=E).tolist()


@SHAPES
def test_bf16_kernel_matches_an_fp32_product(counts, N, K):
    from rlloom.models import expert_kernels  # Triton: CUDA machines only

    g = torch.Generator(device="cuda").manual_seed(0)
    E, P = len(counts), sum(counts)
    w = (
        torch.randn(E, N, K, device="cuda", generator=g) * torch.rand(E, N, 1, device="cuda", generator=g)
    ).to(torch.bfloat16)
    x = torch.randn(P, K, device="cuda", generator=g).to(torch.bfloat16)
    offsets = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    got = expert_kernels.expert_linear(x, w, offsets)  # the kernel itself, at every row count
    want = _reference(x, w, None, counts)
    assert got.dtype == torch.bfloat16 and got.shape == (P, N)
    err = float((got.float() - want).norm() / want.norm())
    assert err < 4e-3, err


@pytest.mark.parametrize("rows", [2, 8, 16, 32, 33, 256])
def test_expert_linear_takes_the_kernel_at_decode_rows_and_grouped_mm_above(rows):
    from rlloom.models import expert_kernels

    # Each tile size of the bf16 kernel (<= 8, <= 16, <= 32 rows an expert), then torch._grouped_mm.
    g = torch.Generator(device="cuda").manual_seed(rows)
    E, N, K = 16, 384, 512
    counts = _skewed(E, rows, g)
    w = (torch.randn(E, N, K, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(sum(counts), K, device="cuda", generator=g).to(torch.bfloat16)
    offsets = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    got = expert_linear(x, w, offsets)
    grouped = torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)
    assert expert_kernels.fits_rows(len(x), E) == (rows <= expert_kernels.MAX_BF16_ROWS)
    if rows > expert_kernels.MAX_BF16_ROWS:
        assert torch.equal(got, grouped)
    err = float((got.float() - _reference(x, w, None, counts)).norm() / grouped.float().norm())
    assert err < 4e-3, err
