"""The MoE combine's Triton kernels (rlloom/models/moe_kernels.py) against the torch code of the same
ops, values and gradients, eager and inside torch.compile. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from rlloom.models.moe import (
    _combine_grad_torch,
    _gather_sum_torch,
    combine_rows,
    dispatch_rows,
    inverse_permutation,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _routing(T: int, K: int, E: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order, inverse, weights_TK fp32) for T tokens with K distinct experts each, skewed loads."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g) + torch.linspace(3, 0, E)  # the first experts popular
    experts_TK = logits.topk(K, dim=-1).indices if T else torch.zeros(0, K, dtype=torch.long)
    order = torch.argsort(experts_TK.flatten(), stable=True).cuda()
    weights_TK = torch.rand(T, K, generator=g).cuda()
    return order, inverse_permutation(order), weights_TK


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T,K,D", [(0, 8, 2048), (1, 8, 2048), (333, 8, 2048), (97, 6, 7168), (64, 2, 96)])
def test_kernels_equal_torch(T, K, D, dtype):
    from rlloom.models import moe_kernels

    order, inverse, weights_TK = _routing(T, K, 16, seed=T + K)
    g = torch.Generator(device="cuda").manual_seed(1)
    src_PD = torch.randn(T * K, D, device="cuda", generator=g).to(dtype)
    grad_TD = torch.randn(T, D, device="cuda", generator=g).to(dtype)
    index_TK = inverse.view(T, K)
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    for weights in (weights_TK, None):
        torch.testing.assert_close(
            moe_kernels.gather_sum(src_PD, index_TK, weights),
            _gather_sum_torch(src_PD, index_TK, weights),
            **tol,
        )
    got = moe_kernels.combine_grad(grad_TD, src_PD, index_TK, weights_TK)
    want = _combine_grad_torch(grad_TD, src_PD, index_TK, weights_TK)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, **tol)


def test_compiled_dispatch_combine_matches_fp64_reference():
    """dispatch -> a row function -> combine, compiled with dynamic shapes (as the training layers
    are) in bf16, against the same chain in fp64 on the CPU (torch code): values and gradients."""
    T, K, E, D = 1000, 8, 32, 512
    order, inverse, weights_TK = _routing(T, K, E, seed=0)
    scale = torch.randn(D, device="cuda")

    def chain(x_TD, w_TK, order, inverse):
        ys = torch.tanh(dispatch_rows(x_TD, order, inverse, K)) * scale.to(x_TD.dtype)
        return combine_rows(ys, inverse, w_TK)

    x = torch.randn(T, D, device="cuda")
    grad_out = torch.randn(T, D, device="cuda")
    compiled = torch.compile(chain, dynamic=True)
    results = []
    for fn, dev, dtype in ((compiled, "cuda", torch.bfloat16), (chain, "cpu", torch.float64)):
        xi = x.to(dev, dtype).requires_grad_()
        wi = weights_TK.to(dev, torch.float64 if dev == "cpu" else torch.float32).requires_grad_()
        if dev == "cpu":
            scale = scale.cpu().double()
        out = fn(xi, wi, order.to(dev), inverse.to(dev))
        grads = torch.autograd.grad(out, (xi, wi), grad_out.to(dev, dtype))
        results.append([t.double().cpu() for t in (out, *grads)])
    for a, b in zip(*results, strict=True):
        rel = float((a - b).norm() / b.norm())
        assert rel < 1e-2, rel


@pytest.mark.parametrize("compiled", [False, True])
def test_router_logits_equal_fp32_and_gradients_are_close(compiled):
    """The bf16 tensor-core router GEMM with an fp32 output against the fp32 GEMM of the upcast
    operands: the same products summed in fp32 (so within fp32 rounding), and the gradients within
    bf16 rounding of the fp32 path's."""
    from rlloom.models.moe import router_logits

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 2048, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(128, 2048, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_()
    up = torch.randn(4096, 128, device="cuda", generator=g)
    fn = torch.compile(router_logits) if compiled else router_logits
    got = fn(x, w)
    assert got.dtype == torch.float32
    gx, gw = torch.autograd.grad((got * up).sum(), (x, w))
    x32, w32 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    want = torch.nn.functional.linear(x32, w32)
    wx, ww = torch.autograd.grad((want * up).sum(), (x32, w32))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in ((gx, wx), (gw, ww)):
        assert a.dtype == torch.bfloat16
        assert ((a.float() - b).norm() / b.norm()).item() < 1e-2
