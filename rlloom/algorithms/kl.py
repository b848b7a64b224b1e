"""KL estimators against a reference policy, and token entropy from logits.

Shape legend: B sequences, T response tokens, V vocabulary, N flattened rows (tokens).

KL estimators follow Schulman, "Approximating KL Divergence" (2020): with samples from the
policy, and log r = ref_logp - logp,
  k1 = -log r = logp - ref_logp        unbiased, high variance, can be negative
  k2 = 0.5 * (log r)^2                  biased, low variance, >= 0
  k3 = r - 1 - log r                    unbiased, low variance, >= 0
  abs = |logp - ref_logp|
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from rlloom.algorithms._validate import check_finite, check_same_shape, check_tensor, float_input

KL_KINDS = ("k1", "k2", "k3", "abs")

# k3 = exp(log r) - log r - 1 explodes for large |log r| (a token the reference finds far likelier
# than the policy); clamping the log-ratio avoids overflow and the result clamp bounds one token's
# pull on the loss, as in common RL stacks.
K3_MAX_LOG_RATIO = 20.0
K3_MAX_VALUE = 10.0


def kl_estimate(logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from logprobs of tokens sampled by the policy.

    kind: "k1" (logp - ref), "k2" (0.5 (logp - ref)^2), "k3" (exp(ref - logp) - (ref - logp) - 1,
    log-ratio clamped to [-20, 20], result clamped to [-10, 10]) or "abs" (|logp - ref|).
    logp_BT, ref_logp_BT: same shape, usually [B, T]. Returns kl_BT of that shape (the caller masks
    and aggregates it like any per-token loss).
    """
    if kind not in KL_KINDS:
        raise ValueError(f"kind={kind!r} is not a KL estimator; valid kinds are {', '.join(KL_KINDS)}.")
    logp_BT = float_input("logp_BT", logp_BT)
    ref_logp_BT = float_input("ref_logp_BT", ref_logp_BT)
    check_same_shape("ref_logp_BT", ref_logp_BT, "logp_BT", logp_BT)
    diff_BT = logp_BT - ref_logp_BT
    if kind == "k1":
        return diff_BT
    if kind == "k2":
        return 0.5 * diff_BT.square()
    if kind == "abs":
        return diff_BT.abs()
    log_ratio_BT = (-diff_BT).clamp(-K3_MAX_LOG_RATIO, K3_MAX_LOG_RATIO)
    return (torch.expm1(log_ratio_BT) - log_ratio_BT).clamp(-K3_MAX_VALUE, K3_MAX_VALUE)


def _entropy_fp32(logits_NV: torch.Tensor) -> torch.Tensor:
    # Entropy is shift-invariant; subtracting the row max first avoids the cancellation of two
    # large numbers in logsumexp(x) - E[x] when logits are large (1e4 loses ~1e-3 in fp32).
    logits_NV = logits_NV if logits_NV.dtype == torch.float64 else logits_NV.float()
    logits_NV = logits_NV - logits_NV.max(dim=-1, keepdim=True).values.detach()
    probs_NV = torch.softmax(logits_NV, dim=-1)
    return torch.logsumexp(logits_NV, dim=-1) - (probs_NV * logits_NV).sum(dim=-1)


def _check_logits(name: str, logits: object) -> torch.Tensor:
    logits = check_tensor(name, logits)
    if logits.dim() < 1 or not logits.is_floating_point():
        raise ValueError(
            f"{name} has shape {tuple(logits.shape)} and dtype {logits.dtype}; it must be floating with the "
            "vocabulary as its last dim. Fix: pass the model's logits [..., V]."
        )
    return logits


def entropy_from_logits(logits_BTV: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim, computed in fp32: H = logsumexp(x) - sum softmax(x) * x.

    logits_BTV: [..., V] any floating dtype (bf16/fp16/fp32 are computed in fp32, fp64 stays fp64).
    Returns entropy [...] (e.g. [B, T]) in fp32, or fp64 for fp64 logits.
    """
    logits_BTV = _check_logits("logits_BTV", logits_BTV)
    check_finite("logits_BTV", logits_BTV)
    return _entropy_fp32(logits_BTV)


def entropy_from_logits_chunked(logits_NV: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """`entropy_from_logits` converting at most `chunk_size` rows to fp32 at a time.

    Each chunk runs under activation checkpointing when gradients are needed, so its fp32 softmax
    is recomputed in backward instead of kept: peak extra memory is one chunk of fp32 [chunk, V].
    Values and gradients equal the unchunked function.

    logits_NV: [N, V] or [B, T, V] (any leading dims). chunk_size: rows per chunk, >= 1.
    Returns entropy of the leading shape, fp32 (fp64 for fp64 logits).
    """
    logits_NV = _check_logits("logits_NV", logits_NV)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size!r} must be an int >= 1. Fix: use e.g. 1024 rows.")
    lead_shape = logits_NV.shape[:-1]
    rows_NV = logits_NV.reshape(-1, logits_NV.shape[-1])
    use_checkpoint = torch.is_grad_enabled() and rows_NV.requires_grad
    chunks = []
    for start in range(0, rows_NV.shape[0], chunk_size):
        chunk_CV = rows_NV[start : start + chunk_size]
        check_finite("logits_NV", chunk_CV)
        if use_checkpoint:
            chunks.append(checkpoint(_entropy_fp32, chunk_CV, use_reentrant=False))
        else:
            chunks.append(_entropy_fp32(chunk_CV))
    if not chunks:
        dtype = torch.float64 if logits_NV.dtype == torch.float64 else torch.float32
        return torch.zeros(lead_shape, dtype=dtype, device=logits_NV.device)
    return torch.cat(chunks).reshape(lead_shape)


def adaptive_kl_coef(
    coef: float, observed_kl: float, num_samples: int, *, target: float, horizon: int
) -> float:
    """The KL coefficient after one step of the adaptive controller of Ziegler et al. (2019), used by
    InstructGPT, TRL's PPO and verl (kl_ctrl.type=adaptive): the coefficient grows when the observed
    KL is above `target` and shrinks below it, by at most 20% of `num_samples / horizon` a step:
    coef x (1 + clip(observed_kl / target - 1, -0.2, 0.2) x num_samples / horizon).

    `observed_kl`: the step's mean over samples of each sample's mean per-token KL; `num_samples`:
    the samples it was measured on (the controller's n_steps)."""
    error = min(max(observed_kl / target - 1.0, -0.2), 0.2)
    return coef * (1.0 + error * num_samples / horizon)
