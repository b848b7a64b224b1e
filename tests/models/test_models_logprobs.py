"""The chunked logprob/entropy head against log_softmax of the full logits (values and gradients)."""

from __future__ import annotations

import pytest
import torch
from models_testutil import assert_close

from rlloom.models.logprobs import token_logprobs

N, D, V = 37, 16, 50


def _inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=gen, requires_grad=True)
    weight = torch.randn(V, D, generator=gen, requires_grad=True)
    targets = torch.randint(0, V, (N,), generator=gen)
    return hidden, weight, targets


def _reference(hidden, weight, targets, temperature):
    logp_all = torch.log_softmax((hidden @ weight.T).float() / temperature, dim=-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp_all.gather(-1, targets[:, None]).squeeze(-1), entropy


@pytest.mark.parametrize("chunk_tokens", [1, 8, 37, 1024])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_grads_match_full_log_softmax(chunk_tokens, temperature):
    hidden, weight, targets = _inputs()
    logp, entropy = token_logprobs(
        hidden, weight, targets, temperature=temperature, chunk_tokens=chunk_tokens, with_entropy=True
    )
    ref_logp, ref_entropy = _reference(hidden, weight, targets, temperature)
    assert logp.dtype == torch.float32 and entropy.dtype == torch.float32
    assert_close(logp, ref_logp, atol=5e-5)
    assert_close(entropy, ref_entropy, atol=5e-5)
    upstream = torch.randn(N, generator=torch.Generator().manual_seed(9))
    grads = torch.autograd.grad((logp * upstream).sum() + 0.3 * entropy.sum(), (hidden, weight))
    ref_grads = torch.autograd.grad((ref_logp * upstream).sum() + 0.3 * ref_entropy.sum(), (hidden, weight))
    for g, r in zip(grads, ref_grads):
        assert_close(g, r, atol=1e-4)  # grads are O(10); fp32 sums in another order


def test_bf16_hidden_matches_reference_and_no_entropy_by_default():
    hidden, weight, targets = _inputs(1)
    h16, w16 = hidden.detach().bfloat16(), weight.detach().bfloat16()
    logp, entropy = token_logprobs(h16, w16, targets, chunk_tokens=10)
    assert entropy is None and logp.dtype == torch.float32
    ref = torch.log_softmax((h16 @ w16.T).float(), -1).gather(-1, targets[:, None]).squeeze(-1)
    assert_close(logp, ref, atol=1e-6)


@pytest.mark.parametrize("chunk_tokens", [10, 64])  # four chunks of bf16 products, or one
def test_bf16_weight_gradient_sums_the_chunks_in_fp32(chunk_tokens):
    # Each chunk's bf16 product grad_C^T h_C is summed in fp32 and rounded once, at the end: with
    # one chunk that is the product itself.
    hidden, weight, targets = _inputs(2)
    h16 = (hidden.detach() * 4).bfloat16()
    w16 = weight.detach().bfloat16().requires_grad_()
    upstream = torch.randn(N, generator=torch.Generator().manual_seed(3))
    logp, _ = token_logprobs(h16, w16, targets, chunk_tokens=chunk_tokens)
    (grad_w,) = torch.autograd.grad((logp * upstream).sum(), (w16,))
    assert grad_w.dtype == torch.bfloat16
    # the logit gradient as the head computes it: -upstream * p, plus upstream at the target
    p = (h16 @ w16.detach().T).float().softmax(-1)
    grad_z = (-upstream[:, None] * p).scatter_add(-1, targets[:, None], upstream[:, None])
    want = torch.zeros(V, D)
    for lo in range(0, N, chunk_tokens):
        g = grad_z[lo : lo + chunk_tokens].bfloat16()
        want += g.T @ h16[lo : lo + chunk_tokens]
    assert torch.equal(grad_w, want.bfloat16())


def test_rejects_bad_arguments():
    hidden, weight, targets = _inputs()
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(hidden, weight, targets, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_tokens"):
        token_logprobs(hidden, weight, targets, chunk_tokens=0)
    with pytest.raises(ValueError, match="targets_N"):
        token_logprobs(hidden, weight, targets[:3])


def test_autograd_never_keeps_more_than_one_chunk_of_logits():
    hidden, weight, targets = _inputs(2)
    saved_shapes: list[tuple[int, ...]] = []

    def pack(t):
        saved_shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, entropy = token_logprobs(hidden, weight, targets, chunk_tokens=8, with_entropy=True)
    logits_like = [s for s in saved_shapes if s and s[-1] == V]
    assert all(s[0] <= 8 for s in logits_like), saved_shapes  # at most one chunk of [chunk, V] logits
    logp.sum().backward()
    assert hidden.grad is not None and weight.grad is not None


@pytest.mark.parametrize("needs", ["hidden", "weight"])
def test_gradient_of_logp_alone_with_entropy_returned_but_unused(needs):
    """The entropy output gets no gradient (None in the backward) and only one input needs one."""
    hidden, weight, targets = _inputs(3)
    hidden.requires_grad_(needs == "hidden")
    weight.requires_grad_(needs == "weight")
    logp, _ = token_logprobs(hidden, weight, targets, chunk_tokens=5, with_entropy=True, temperature=1.3)
    ref_logp, _ = _reference(hidden, weight, targets, 1.3)
    leaf = hidden if needs == "hidden" else weight
    (got,) = torch.autograd.grad(logp.sum(), leaf)
    (want,) = torch.autograd.grad(ref_logp.sum(), leaf)
    assert_close(got, want, atol=1e-4)


HEAD_KERNELS_SCRIPT = r"""
import torch
from rlloom.models import logprob_kernels, logprobs

gen = torch.Generator().manual_seed(0)
C, V = 5, 9000  # two statistics slices, the second partial
for dtype in (torch.float32, torch.bfloat16):
    logits = (torch.randn(C, V, generator=gen) * 3).to(dtype)
    targets = torch.tensor([0, V - 1, 8191, 8192, 17])
    grad_logp, grad_entropy = torch.randn(C, generator=gen), torch.randn(C, generator=gen)
    for inv_temp in (1.0, 1 / 0.7):
        for with_entropy in (False, True):
            want = logprobs.chunk_stats(logits, targets, inv_temp, with_entropy)
            got = logprob_kernels.chunk_stats(logits, targets, inv_temp, with_entropy)
            for w, g in zip(want, got):
                assert (w is None) == (g is None) and (w is None or (w - g).abs().max() < 1e-4), (w, g)
            lse, entropy = want[1], want[2]
            args = (grad_entropy if with_entropy else None, entropy, inv_temp)
            want = logprobs.chunk_logit_grad(logits, targets, lse, grad_logp, *args)
            got = logprob_kernels.chunk_logit_grad(logits, targets, lse, grad_logp, *args)
            assert got.dtype == dtype and (want.float() - got.float()).abs().max() <= 1e-6 + 1e-2 * want.float().abs().max()
print("ok")
"""


def test_triton_head_kernels_in_the_interpreter():
    """The CUDA head kernels against the torch passes (Triton's CPU interpreter; skipped without Triton)."""
    pytest.importorskip("triton")
    from models_testutil import run_in_triton_interpreter

    run_in_triton_interpreter(HEAD_KERNELS_SCRIPT)
