"""The MoE token permutation (dispatch_rows / combine_rows) against the naive index + index_add,
values and gradients, including empty inputs (an EP rank that receives no token)."""

from __future__ import annotations

import pytest
import torch

from rlloom.models.moe import combine_rows, dispatch_rows, inverse_permutation


def naive(x_TD, experts_TK, weights_TK, f):
    """The pre-permutation reference: x[token_of], f per row, weights, index_add into the tokens."""
    K = experts_TK.shape[1]
    order = torch.argsort(experts_TK.flatten(), stable=True)
    token_of = order // K
    ys = f(x_TD[token_of]) * weights_TK.flatten()[order].unsqueeze(-1)
    return torch.zeros_like(x_TD).index_add(0, token_of, ys)


def fast(x_TD, experts_TK, weights_TK, f):
    order = torch.argsort(experts_TK.flatten(), stable=True)
    inverse = inverse_permutation(order)
    return combine_rows(f(dispatch_rows(x_TD, order, inverse, experts_TK.shape[1])), inverse, weights_TK)


@pytest.mark.parametrize("T,K,E", [(7, 2, 4), (1, 3, 8), (0, 2, 4), (33, 8, 16)])
def test_dispatch_and_combine_equal_index_add(T, K, E):
    g = torch.Generator().manual_seed(T * 100 + K)
    x = torch.randn(T, 5, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.rand(T, K, dtype=torch.float64, generator=g, requires_grad=True)
    experts = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.zeros(0, K)
    experts = experts.long()
    scale = torch.randn(5, dtype=torch.float64, generator=g)
    # A row function that is not linear in x, with a position-dependent part (which expert slot).
    f = lambda r: torch.tanh(r) * scale + torch.arange(len(r), dtype=r.dtype).unsqueeze(-1) * 0.01  # noqa: E731
    ref, out = naive(x, experts, w, f), fast(x, experts, w, f)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    if T:
        grad_out = torch.randn_like(ref)
        ref_grads = torch.autograd.grad(ref, (x, w), grad_out)
        out_grads = torch.autograd.grad(out, (x, w), grad_out)
        for a, b in zip(out_grads, ref_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        if T * K < 64:  # the comparison above covers the large case; gradcheck costs T*K*5 passes
            assert torch.autograd.gradcheck(lambda x, w: fast(x, experts, w, f), (x, w))


def test_inverse_permutation():
    order = torch.randperm(50)
    inv = inverse_permutation(order)
    assert torch.equal(order[inv], torch.arange(50)) and torch.equal(inv[order], torch.arange(50))


def test_route_mismatch_equals_set_comparison():
    """Counts tokens whose expert set differs from the record (order within a row ignored, rows of
    -1 not compared), against a loop over Python sets."""
    from rlloom.models.moe import route_mismatch

    gen = torch.Generator().manual_seed(0)
    T, K, E = 200, 4, 8
    own = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    routes = own.clone()
    for t in range(T):  # a third kept (reordered), a third with one expert swapped, a third unrecorded
        if t % 3 == 0:
            routes[t] = routes[t][torch.randperm(K, generator=gen)]
        elif t % 3 == 1:
            routes[t, t % K] = next(e for e in range(E) if e not in own[t].tolist())
        else:
            routes[t] = -1
    want_differ = sum(set(own[t].tolist()) != set(routes[t].tolist()) and t % 3 != 2 for t in range(T))
    want_valid = sum(t % 3 != 2 for t in range(T))
    assert route_mismatch(own, routes).tolist() == [float(want_differ), float(want_valid)]
