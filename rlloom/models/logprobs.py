"""Chunked logprob / entropy head: per-token log p(target) without materialising all fp32 logits.

token_logprobs computes log_softmax((h @ W.T).float() / temperature)[target] chunk by chunk over
tokens, so fp32 logits of at most `chunk_tokens` tokens exist at once (a 4096-token chunk of a
151936-token vocabulary is 2.5 GB in fp32, a full 32k-token batch would be 20 GB). When a gradient
is needed each chunk runs under activation checkpointing (non-reentrant): the forward keeps only
the chunk's inputs and the backward recomputes that chunk's logits, so memory stays bounded in the
backward pass too, at the cost of one extra [chunk, D] x [D, V] matmul per chunk.

The rollout engine returns the same quantity for sampled tokens: temperature-scaled logprobs
before any top-p/top-k truncation.

Shape legend: N tokens, D hidden, V vocabulary.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def _chunk_logprobs(
    hidden_CD: torch.Tensor,
    weight_VD: torch.Tensor,
    targets_C: torch.Tensor,
    temperature: float,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    logits_CV = (hidden_CD @ weight_VD.T).float()
    if temperature != 1.0:
        logits_CV = logits_CV / temperature
    lse_C = logits_CV.logsumexp(dim=-1)
    logp_C = logits_CV.gather(-1, targets_C.unsqueeze(-1)).squeeze(-1) - lse_C
    if not with_entropy:
        return logp_C, None
    probs_CV = torch.exp(logits_CV - lse_C.unsqueeze(-1))
    entropy_C = lse_C - (probs_CV * logits_CV).sum(dim=-1)
    return logp_C, entropy_C


def token_logprobs(
    hidden_ND: torch.Tensor,
    weight_VD: torch.Tensor,
    targets_N: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities of `targets_N` and optionally the entropy of each position, both fp32 [N].

    hidden_ND: [N, D] final-normed hidden states (any float dtype).
    weight_VD: [V, D] lm head weight (`CausalLM.lm_head_weight`).
    targets_N: [N] int64 token ids whose logprob is returned.
    temperature: divides the logits (the sampling temperature of the policy), > 0.
    chunk_tokens: tokens per chunk, >= 1.
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
    needs_grad = torch.is_grad_enabled() and (hidden_ND.requires_grad or weight_VD.requires_grad)
    logps, entropies = [], []
    for start in range(0, hidden_ND.shape[0], chunk_tokens):
        args = (hidden_ND[start : start + chunk_tokens], weight_VD, targets_N[start : start + chunk_tokens])
        if needs_grad:
            logp, entropy = checkpoint(_chunk_logprobs, *args, temperature, with_entropy, use_reentrant=False)
        else:
            logp, entropy = _chunk_logprobs(*args, temperature, with_entropy)
        logps.append(logp)
        entropies.append(entropy)
    if not logps:
        empty = hidden_ND.new_zeros(0, dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    logp_N = torch.cat(logps)
    return logp_N, (torch.cat(entropies) if with_entropy else None)
