"""The chunked logprob / entropy head on a vocabulary-sharded lm head, never gathering full logits.

Each of the `tp` ranks holds rows [r * V/tp, (r + 1) * V/tp) of the [V, D] head weight and all N
hidden states (gathered from the token shards). Per chunk of C tokens a rank computes its [C, V/tp]
logits in fp32 (temperature-scaled, z) and the softmax statistics are combined over the ranks:

    m = max over ranks of the local max            (one all-reduce MAX)
    s = sum exp(z - m),  z[target],  sum exp(z - m) * z   (one all-reduce SUM of the three)
    lse = m + log s,  logp = z[target] - lse,  entropy = lse - sum(exp(z - m) * z) / s

Only the rank owning a token's target contributes its logit. The backward recomputes each chunk's
local logits and applies the same logit gradient as `rlloom.models.logprobs` (onehot - p for the
logprob, -p (z - lse + H) for the entropy) to the local vocabulary slice; the weight gradient stays
local (each rank owns its rows), the hidden-state gradient is a sum over the ranks' slices (one
all-reduce at the end). Values and gradients equal `token_logprobs` on the unsharded head.

Under exact numerics (`rollout.match_training`, models/exact.py) the forward instead gathers each
chunk's full-vocabulary logits in rank order and takes the one-process head's `chunk_stats` on them,
as the rollout's tensor-parallel sampler does (engines/rollout/native/vocab_parallel.py): a logit
column is its own dot product, so both engines see tp = 1's logits and normalise them by the same
log-sum-exp, where the ranks' statistics combined above round otherwise than it (measured on the
CPU: gaps of 4.8e-7). It costs a [C, V] gather per chunk; the backward is unchanged.

Shape legend: N tokens, C tokens of a chunk, D hidden, V vocabulary, Vl = V / tp local rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from rlloom.models.exact import is_exact
from rlloom.models.logprobs import chunk_stats


def _local_stats(
    hidden_CD: torch.Tensor,
    weight_VlD: torch.Tensor,
    local_targets_C: torch.Tensor,
    owned_C: torch.Tensor,
    inv_temp: float,
    with_entropy: bool,
    group: dist.ProcessGroup,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """fp32 (logp [C], lse [C], entropy [C] or None) of one chunk, combined over the group."""
    z_CV = (hidden_CD @ weight_VlD.T).float() * inv_temp
    m_C = z_CV.max(dim=-1).values
    dist.all_reduce(m_C, op=dist.ReduceOp.MAX, group=group)
    e_CV = torch.exp(z_CV - m_C.unsqueeze(-1))
    target_C = z_CV.gather(-1, local_targets_C.unsqueeze(-1)).squeeze(-1) * owned_C
    parts = [e_CV.sum(dim=-1), target_C]
    if with_entropy:
        parts.append((e_CV * z_CV).sum(dim=-1))
    sums = torch.stack(parts)
    dist.all_reduce(sums, group=group)
    lse_C = m_C + sums[0].log()
    entropy_C = lse_C - sums[2] / sums[0] if with_entropy else None
    return sums[1] - lse_C, lse_C, entropy_C


def _gathered_stats(
    hidden_CD: torch.Tensor,
    weight_VlD: torch.Tensor,
    targets_C: torch.Tensor,
    inv_temp: float,
    with_entropy: bool,
    group: dist.ProcessGroup,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`_local_stats` under exact numerics: the chunk's full logits [C, V] (the ranks' columns in
    rank order) through `chunk_stats`, the unsharded head's (module docstring)."""
    logits_CVl = (hidden_CD @ weight_VlD.T).contiguous()
    parts = [torch.empty_like(logits_CVl) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, logits_CVl, group=group)
    return chunk_stats(torch.cat(parts, dim=-1), targets_C, inv_temp, with_entropy)


class _VocabParallelHead(torch.autograd.Function):
    @staticmethod
    def forward(  # noqa: ANN205
        ctx,  # noqa: ANN001
        hidden_ND: torch.Tensor,
        weight_VlD: torch.Tensor,
        targets_N: torch.Tensor,
        vocab_start: int,
        inv_temp: float,
        chunk: int,
        with_entropy: bool,
        group: dist.ProcessGroup,
    ):
        num_local = weight_VlD.shape[0]
        local_N = targets_N - vocab_start
        owned_N = (local_N >= 0) & (local_N < num_local)
        local_N = local_N.clamp(0, num_local - 1)
        logps, lses, entropies = [], [], []
        for start in range(0, hidden_ND.shape[0], chunk):
            sl = slice(start, start + chunk)
            if is_exact():
                stats = _gathered_stats(
                    hidden_ND[sl], weight_VlD, targets_N[sl], inv_temp, with_entropy, group
                )
            else:
                stats = _local_stats(
                    hidden_ND[sl], weight_VlD, local_N[sl], owned_N[sl], inv_temp, with_entropy, group
                )
            logp, lse, entropy = stats
            logps.append(logp)
            lses.append(lse)
            entropies.append(entropy)
        logp_N, lse_N = torch.cat(logps), torch.cat(lses)
        entropy_N = torch.cat(entropies) if with_entropy else None
        ctx.save_for_backward(hidden_ND, weight_VlD, local_N, owned_N, lse_N, entropy_N)
        ctx.inv_temp, ctx.chunk, ctx.group = inv_temp, chunk, group
        ctx.set_materialize_grads(False)
        return logp_N, entropy_N

    @staticmethod
    def backward(ctx, grad_logp_N: torch.Tensor | None, grad_entropy_N: torch.Tensor | None):  # noqa: ANN001, ANN205
        hidden_ND, weight_VlD, local_N, owned_N, lse_N, entropy_N = ctx.saved_tensors
        if grad_logp_N is None:
            grad_logp_N = torch.zeros_like(lse_N)
        grad_h = torch.zeros_like(hidden_ND)
        grad_w = torch.zeros(weight_VlD.shape, dtype=torch.float32, device=weight_VlD.device)
        for start in range(0, hidden_ND.shape[0], ctx.chunk):
            sl = slice(start, start + ctx.chunk)
            hidden_CD = hidden_ND[sl]
            logits_CV = hidden_CD @ weight_VlD.T
            z_CV = logits_CV.float() * ctx.inv_temp
            p_CV = torch.exp(z_CV - lse_N[sl].unsqueeze(-1))
            g_C = grad_logp_N[sl]
            grad_CV = -g_C.unsqueeze(-1) * p_CV
            if grad_entropy_N is not None:
                shift_C = lse_N[sl] - entropy_N[sl]
                grad_CV = grad_CV - grad_entropy_N[sl].unsqueeze(-1) * p_CV * (z_CV - shift_C.unsqueeze(-1))
            owned_g_C = (g_C * owned_N[sl]).unsqueeze(-1)
            grad_CV = grad_CV.scatter_add(-1, local_N[sl].unsqueeze(-1), owned_g_C) * ctx.inv_temp
            grad_CV = grad_CV.to(logits_CV.dtype)
            grad_h[sl] = grad_CV @ weight_VlD
            grad_w.add_(grad_CV.T.float() @ hidden_CD.float())
        dist.all_reduce(grad_h, group=ctx.group)  # each rank's vocabulary slice adds to every token
        return grad_h, grad_w.to(weight_VlD.dtype), None, None, None, None, None, None


def vocab_parallel_token_logprobs(
    hidden_ND: torch.Tensor,
    weight_VD: DTensor,
    targets_N: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`rlloom.models.logprobs.token_logprobs` for an lm head sharded over the vocabulary.

    hidden_ND: [N, D] final-normed hidden states: a DTensor on the head's mesh in any layout (the
        token shards `apply_tp` produces are all-gathered here), or a plain tensor holding all N
        tokens on every rank.
    weight_VD: [V, D] lm head weight, a DTensor Shard(0) on a 1-D mesh (`CausalLM.lm_head_weight`
        after `apply_tp`), V divisible by the mesh size.
    targets_N: [N] int64 token ids, the same on every rank.
    Returns fp32 logp [N] and entropy [N] (or None), plain tensors, the same on every rank.
    """
    if (
        not isinstance(weight_VD, DTensor)
        or weight_VD.device_mesh.ndim != 1
        or weight_VD.placements != (Shard(0),)
    ):
        raise ValueError(
            f"vocab_parallel_token_logprobs: the head weight must be a DTensor sharded over the vocabulary "
            f"(Shard(0) on a 1-D mesh); got {type(weight_VD).__name__} "
            f"{getattr(weight_VD, 'placements', None)}. Fix: apply rlloom.parallel.tp.apply_tp to the model first."
        )
    if temperature <= 0 or chunk_tokens < 1:
        raise ValueError(
            f"vocab_parallel_token_logprobs: temperature={temperature} must be > 0 and chunk_tokens={chunk_tokens} "
            ">= 1. Fix: pass the rollout sampling temperature (e.g. 1.0) and e.g. 1024 tokens per chunk."
        )
    mesh = weight_VD.device_mesh
    vocab, tp = weight_VD.shape[0], mesh.size()
    if vocab % tp:
        raise ValueError(
            f"vocab_parallel_token_logprobs: vocab_size={vocab} is not divisible by tp={tp}. "
            "Fix: use a tp that divides the vocabulary size."
        )
    if isinstance(hidden_ND, DTensor):
        hidden_ND = hidden_ND.redistribute(mesh, [Replicate()]).to_local()
    if hidden_ND.shape[0] != targets_N.shape[0]:
        raise ValueError(
            f"vocab_parallel_token_logprobs: {hidden_ND.shape[0]} hidden states but {targets_N.shape[0]} targets. "
            "Fix: pass one target per hidden state."
        )
    if hidden_ND.shape[0] == 0:  # the same on every rank (targets are), so no rank waits
        empty = hidden_ND.new_zeros(0, dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    weight_VlD = weight_VD.to_local()
    vocab_start = mesh.get_local_rank() * (vocab // tp)
    args = (hidden_ND, weight_VlD, targets_N, vocab_start, 1.0 / temperature, chunk_tokens, with_entropy)
    return _VocabParallelHead.apply(*args, mesh.get_group())
