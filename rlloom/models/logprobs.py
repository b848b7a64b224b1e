"""Chunked logprob / entropy head: per-token log p(target) without materialising all fp32 logits.

token_logprobs computes log_softmax((h @ W.T).float() / temperature)[target] chunk by chunk over
tokens, so logits of at most `chunk_tokens` tokens exist at once (a 4096-token chunk of a
151936-token vocabulary is 1.2 GB in bf16, a full 32k-token batch would be 20 GB in fp32).

With a gradient, one autograd Function (`_LogprobHead`) runs the chunks: the forward keeps only the
inputs and each token's log-sum-exp (and entropy), the backward recomputes each chunk's logits with
one matmul and turns them into the logit gradient in one elementwise pass:

    z = logits / T,  p = softmax(z),  logp = z[target] - lse,  H = lse - sum(p * z)
    dlogp/dz = onehot(target) - p,    dH/dz = -p * (z - lse + H)

The weight gradient is summed over chunks in fp32 (one chunk: its product as it is) and cast once
at the end. On CUDA with `fused=True` the two elementwise passes (statistics, logit gradient) are
the Triton kernels of `logprob_kernels.py`: each reads the chunk's bf16 logits once and the
gradient pass writes its result in bf16, where the torch code materialises several fp32 [chunk, V]
temporaries (upcast, exp, softmax, scatter, sum) and is memory-bound.

The rollout engine returns the same quantity for sampled tokens: temperature-scaled logprobs
before any top-p/top-k truncation.

Shape legend: N tokens, C tokens of a chunk, D hidden, V vocabulary.
"""

from __future__ import annotations

import torch

from rlloom.models.exact import is_exact


def scaled_logprobs(
    logits_CV: torch.Tensor, targets_C: torch.Tensor, inv_temp: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 (z [C, V], logp [C], lse [C]): the temperature-scaled logits z, the targets' logprob and
    z's log-sum-exp (under exact numerics the numerics' `row_logsumexp`, the sampler's order)."""
    z_CV = logits_CV.float()
    if inv_temp != 1.0:
        z_CV = z_CV * inv_temp
    lse_C = z_CV.logsumexp(dim=-1)
    return z_CV, z_CV.gather(-1, targets_C.unsqueeze(-1)).squeeze(-1) - lse_C, lse_C


def chunk_stats(
    logits_CV: torch.Tensor, targets_C: torch.Tensor, inv_temp: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """fp32 (logp [C], lse [C], entropy [C] or None) of the temperature-scaled logits."""
    z_CV, logp_C, lse_C = scaled_logprobs(logits_CV, targets_C, inv_temp)
    if not with_entropy:
        return logp_C, lse_C, None
    entropy_C = lse_C - (torch.exp(z_CV - lse_C.unsqueeze(-1)) * z_CV).sum(dim=-1)
    return logp_C, lse_C, entropy_C


def chunk_logit_grad(
    logits_CV: torch.Tensor,
    targets_C: torch.Tensor,
    lse_C: torch.Tensor,
    grad_logp_C: torch.Tensor,
    grad_entropy_C: torch.Tensor | None,
    entropy_C: torch.Tensor | None,
    inv_temp: float,
) -> torch.Tensor:
    """d(sum grad_logp * logp + sum grad_entropy * entropy) / d logits, in the logits' dtype [C, V]."""
    z_CV = logits_CV.float()
    if inv_temp != 1.0:
        z_CV = z_CV * inv_temp
    p_CV = torch.exp(z_CV - lse_C.unsqueeze(-1))
    grad_CV = -grad_logp_C.unsqueeze(-1) * p_CV
    if grad_entropy_C is not None:
        assert entropy_C is not None
        grad_CV = grad_CV - grad_entropy_C.unsqueeze(-1) * p_CV * (z_CV - (lse_C - entropy_C).unsqueeze(-1))
    grad_CV = grad_CV.scatter_add(-1, targets_C.unsqueeze(-1), grad_logp_C.unsqueeze(-1))
    if inv_temp != 1.0:
        grad_CV = grad_CV * inv_temp
    return grad_CV.to(logits_CV.dtype)


def _kernels(fused: bool, exact: bool, device: torch.device):  # noqa: ANN202
    """(statistics pass, logit-gradient pass) for the chunks. Under exact numerics (`exact`: the
    forward ran inside `exact_numerics()`) the statistics keep the numerics' log-sum-exp, whose
    order the rollout's sampler shares, and on CUDA only the entropy's pass is fused
    (`exact_fused.chunk_stats`); the backward needs no batch invariance, only a fixed order, which
    the fused gradient kernel has (elementwise)."""
    if not (fused and device.type == "cuda"):
        return chunk_stats, chunk_logit_grad
    from rlloom.models import logprob_kernels

    if exact:
        from rlloom.models import exact_fused

        return exact_fused.chunk_stats, logprob_kernels.chunk_logit_grad
    return logprob_kernels.chunk_stats, logprob_kernels.chunk_logit_grad


def _add_weight_grad(
    grad_VD: torch.Tensor | None, grad_CV: torch.Tensor, hidden_CD: torch.Tensor
) -> torch.Tensor:
    """grad_VD + grad_CV.T @ hidden_CD: each chunk's product in the compute dtype, the chunks summed
    in fp32. The first chunk's product is returned as it is (None: no sum yet), so a micro-batch of
    one chunk makes no fp32 [V, D] accumulator at all (a zero fill, an add and a cast back: ~1.4 ms
    of a 151,936 x 2048 head on an H200, the same values)."""
    product = grad_CV.T @ hidden_CD
    if grad_VD is None:
        return product
    if grad_VD.dtype != torch.float32:
        grad_VD = grad_VD.float()
    return grad_VD.add_(product)


class _LogprobHead(torch.autograd.Function):
    @staticmethod
    def forward(  # noqa: ANN205
        ctx,  # noqa: ANN001
        hidden_ND: torch.Tensor,
        weight_VD: torch.Tensor,
        targets_N: torch.Tensor,
        inv_temp: float,
        chunk: int,
        with_entropy: bool,
        fused: bool,
        exact: bool,
    ):
        logp_N, lse_N, entropy_N = _chunked_stats(
            hidden_ND, weight_VD, targets_N, inv_temp, chunk, with_entropy, fused, exact
        )
        ctx.save_for_backward(hidden_ND, weight_VD, targets_N, lse_N, entropy_N)
        ctx.inv_temp, ctx.chunk, ctx.fused, ctx.exact = inv_temp, chunk, fused, exact
        ctx.set_materialize_grads(False)
        return logp_N, entropy_N

    @staticmethod
    def backward(ctx, grad_logp_N: torch.Tensor | None, grad_entropy_N: torch.Tensor | None):  # noqa: ANN001, ANN205
        hidden_ND, weight_VD, targets_N, lse_N, entropy_N = ctx.saved_tensors
        _, logit_grad = _kernels(ctx.fused, ctx.exact, hidden_ND.device)
        if grad_logp_N is None:
            grad_logp_N = torch.zeros_like(lse_N)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden_ND) if need_h else None
        grad_w = None
        for start in range(0, hidden_ND.shape[0], ctx.chunk):
            sl = slice(start, start + ctx.chunk)
            hidden_CD = hidden_ND[sl]
            grad_CV = logit_grad(
                hidden_CD @ weight_VD.T,
                targets_N[sl],
                lse_N[sl],
                grad_logp_N[sl],
                None if grad_entropy_N is None else grad_entropy_N[sl],
                None if entropy_N is None else entropy_N[sl],
                ctx.inv_temp,
            )
            if grad_h is not None:
                torch.mm(grad_CV, weight_VD, out=grad_h[sl])
            if need_w:
                grad_w = _add_weight_grad(grad_w, grad_CV, hidden_CD)
        return (
            grad_h,
            (grad_w.to(weight_VD.dtype) if grad_w is not None else None),
            None,
            None,
            None,
            None,
            None,
            None,
        )


def token_logprobs(
    hidden_ND: torch.Tensor,
    weight_VD: torch.Tensor,
    targets_N: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
    with_entropy: bool = False,
    fused: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities of `targets_N` and optionally the entropy of each position, both fp32 [N].

    hidden_ND: [N, D] final-normed hidden states (any float dtype).
    weight_VD: [V, D] lm head weight (`CausalLM.lm_head_weight`).
    targets_N: [N] int64 token ids whose logprob is returned.
    temperature: divides the logits (the sampling temperature of the policy), > 0.
    chunk_tokens: tokens per chunk, >= 1.
    fused: on CUDA, run the elementwise passes as Triton kernels (same math, one read of the logits;
    inside `exact_numerics()` the ones that keep its numerics: `_kernels`).
    """
    if temperature <= 0:
        raise ValueError(
            f"token_logprobs temperature={temperature} must be > 0 (it divides the logits). "
            "Fix: pass the rollout sampling temperature, e.g. 1.0."
        )
    if chunk_tokens < 1:
        raise ValueError(f"token_logprobs chunk_tokens={chunk_tokens} must be >= 1. Fix: use e.g. 1024.")
    if hidden_ND.shape[0] != targets_N.shape[0]:
        raise ValueError(
            f"token_logprobs: hidden_ND has {hidden_ND.shape[0]} tokens but targets_N has {targets_N.shape[0]}. "
            "Fix: pass one target per hidden state."
        )
    if hidden_ND.shape[0] == 0:
        empty = hidden_ND.new_zeros(0, dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    args = (hidden_ND, weight_VD, targets_N, 1.0 / temperature, chunk_tokens, with_entropy, fused, is_exact())
    if torch.is_grad_enabled() and (hidden_ND.requires_grad or weight_VD.requires_grad):
        return _LogprobHead.apply(*args)
    with torch.no_grad():
        logp_N, _, entropy_N = _chunked_stats(*args)
    return logp_N, entropy_N


def _chunked_stats(
    hidden_ND: torch.Tensor,
    weight_VD: torch.Tensor,
    targets_N: torch.Tensor,
    inv_temp: float,
    chunk: int,
    with_entropy: bool,
    fused: bool,
    exact: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(logp [N], lse [N], entropy [N] or None), one chunk of logits at a time."""
    stats, _ = _kernels(fused, exact, hidden_ND.device)
    logps, lses, entropies = [], [], []
    for start in range(0, hidden_ND.shape[0], chunk):
        logits_CV = hidden_ND[start : start + chunk] @ weight_VD.T
        logp, lse, entropy = stats(logits_CV, targets_N[start : start + chunk], inv_temp, with_entropy)
        logps.append(logp)
        lses.append(lse)
        entropies.append(entropy)
    return torch.cat(logps), torch.cat(lses), (torch.cat(entropies) if with_entropy else None)
