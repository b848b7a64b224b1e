"""KL estimators and entropy against naive references; chunked entropy equals unchunked in value and gradient."""

import math
import random

import pytest
import torch

from rlloom.algorithms import KL_KINDS, entropy_from_logits, entropy_from_logits_chunked, kl_estimate


@pytest.fixture
def gen():
    seed = random.randrange(2**31)
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)


def naive_kl(logp, ref, kind):
    if kind == "k1":
        return logp - ref
    if kind == "k2":
        return 0.5 * (logp - ref) ** 2
    if kind == "abs":
        return abs(logp - ref)
    log_ratio = min(max(ref - logp, -20.0), 20.0)
    return min(max(math.exp(log_ratio) - log_ratio - 1, -10.0), 10.0)


@pytest.mark.parametrize("kind", KL_KINDS)
@pytest.mark.parametrize("shape", [(1, 1), (5, 17)])
def test_kl_matches_naive(gen, kind, shape):
    logp_BT = -3 * torch.rand(shape, generator=gen, dtype=torch.float64)
    ref_logp_BT = logp_BT + torch.randn(shape, generator=gen, dtype=torch.float64) * 2
    ref_logp_BT[0, 0] = logp_BT[0, 0] + 30.0  # exercises the k3 clamps
    kl_BT = kl_estimate(logp_BT, ref_logp_BT, kind)
    expected = [
        [naive_kl(a, b, kind) for a, b in zip(r1, r2)]
        for r1, r2 in zip(logp_BT.tolist(), ref_logp_BT.tolist())
    ]
    torch.testing.assert_close(kl_BT, torch.tensor(expected, dtype=torch.float64), rtol=1e-9, atol=1e-12)


def test_k3_is_unbiased_for_kl(gen):
    # samples from p; k3 averages to KL(p || q) for two categorical distributions
    # q close to p keeps every ratio q/p small enough that the k3 clamp at 10 never acts
    logits_V = torch.randn(6, generator=gen, dtype=torch.float64)
    p_V = torch.softmax(logits_V, 0)
    q_V = torch.softmax(logits_V + 0.3 * torch.randn(6, generator=gen, dtype=torch.float64), 0)
    tokens_N = torch.multinomial(p_V, 200_000, replacement=True, generator=gen)
    k3_mean = kl_estimate(p_V.log()[tokens_N], q_V.log()[tokens_N], "k3").mean().item()
    assert k3_mean == pytest.approx((p_V * (p_V / q_V).log()).sum().item(), rel=0.02, abs=1e-3)


def naive_entropy(logits_NV):
    out = []
    for row in logits_NV.double().tolist():
        top = max(row)
        z = sum(math.exp(x - top) for x in row)
        out.append(-sum(math.exp(x - top) / z * ((x - top) - math.log(z)) for x in row))
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_entropy_matches_naive_and_is_stable(gen, dtype):
    logits_BTV = (torch.randn(3, 4, 11, generator=gen) * 5).to(dtype)
    logits_BTV[0, 0] += 1e4 if dtype == torch.float32 else 100.0  # huge logits: no overflow
    entropy_BT = entropy_from_logits(logits_BTV)
    assert entropy_BT.dtype == torch.float32 and entropy_BT.shape == (3, 4)
    expected = naive_entropy(logits_BTV.reshape(12, 11)).reshape(3, 4).float()
    torch.testing.assert_close(entropy_BT, expected, rtol=1e-4, atol=1e-4)


# Four units in the last place of each dtype.
ULPS = {torch.float64: 4 * 2.0**-52, torch.float32: 4 * 2.0**-23, torch.bfloat16: 4 * 2.0**-7}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape,chunk_size", [((7, 13), 3), ((2, 5, 9), 4), ((4, 6), 100), ((3, 5), 1)])
def test_chunked_entropy_equals_unchunked_with_gradients(gen, dtype, shape, chunk_size):
    logits = (torch.randn(shape, generator=gen) * 3).to(dtype).requires_grad_()
    weights = torch.randn(shape[:-1], generator=gen)
    full = entropy_from_logits(logits)
    chunked = entropy_from_logits_chunked(logits, chunk_size)
    # Same math per row, but a chunk of a different row count can take another vectorised kernel
    # path on CPU: allow a few units in the last place (a wrong chunk boundary is off by O(1)).
    tol = ULPS[dtype]
    torch.testing.assert_close(chunked, full, rtol=ULPS[full.dtype], atol=1e-12)
    (grad_full,) = torch.autograd.grad((full * weights).sum(), logits)
    (grad_chunked,) = torch.autograd.grad((chunked * weights).sum(), logits)
    torch.testing.assert_close(grad_chunked, grad_full, rtol=tol, atol=1e-7)


def test_chunked_entropy_without_grad_and_empty(gen):
    logits_NV = torch.randn(10, 5, generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(entropy_from_logits_chunked(logits_NV, 4), entropy_from_logits(logits_NV))
    assert entropy_from_logits_chunked(torch.zeros(0, 5), 4).shape == (0,)
