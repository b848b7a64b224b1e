"""The MoE auxiliary load-balancing loss over real rows and split tokens (train.moe_aux_loss_coef > 0),
shared by the engine at pp=1 (`moe_balance.MoEBalance`) and the pipeline stages (`pp_stages`).

`layers_aux_loss` is the one way both compute it: per MoE layer, the balancing loss of the rows the
layer routed that are real (not padding), from the router's scores (`RouterScores` keeps them
during a forward, not during a recompute of activation checkpointing in backward), times those
rows' number n. Where ranks split a micro-batch's tokens (CP, or TP ranks that each route their
shard), the expert fractions f are summed over them first, as Megatron-LM does over its
sequence-partition group: each rank's term is then E x sum_e f_e x (its rows' part of P_e), and the
terms add up to the whole micro-batch's loss, gradients included (no approximation; the gradient
sum over those ranks, FSDP's over cp or `apply_tp`'s over the TP ranks' router, adds the parts).

Under pipeline parallelism only the last stage computes the policy loss, so the balancing loss of
an earlier stage's MoE layers cannot be added to it. As Megatron-LM's `MoEAuxLossAutoScaler` does,
each stage ties its layers' term to its output with `AttachAuxLoss`: the identity in forward; in
backward it passes the output's gradient through and also back-propagates the term (gradient 1:
the term is already scaled as at pp=1, coef x the micro-batch's token share x the mean over the
whole model's MoE layers, and the policy loss is divided by the global normaliser, so no loss scale
remains). Summed over the stages and micro-batches the gradients are the one-process run's. The
stages run micro-batches padded to one token budget; at pp=1 the only padding is the few tokens
that pad a stream to a multiple of tp (the zero-weight filler micro-batches add no term).

Shape legend: T tokens a layer routed, E experts, K experts per token.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rlloom.models.moe import load_balancing_loss


class AttachAuxLoss(torch.autograd.Function):
    """y = x in forward; backward gives x the gradient of y and `aux` (a scalar) the gradient 1."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (aux,) = ctx.saved_tensors
        return grad, torch.ones_like(aux)


def real_rows_aux_loss(
    scores_TE: torch.Tensor,
    experts_TK: torch.Tensor,
    real_T: torch.Tensor,
    groups: tuple[dist.ProcessGroup, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """(`moe.load_balancing_loss` over the rows `real_T` marks, their number n) without a host sync.

    With the other rows' scores zeroed, their routing probabilities become 0 and the counts only
    include the real rows'; `load_balancing_loss` divides f and P by all T rows, so its value is
    (n / T)^2 times the real rows' loss. With `groups` (the ranks holding the micro-batch's other
    rows) the counts and n are summed over them: the loss is this rank's part of the whole rows'
    (the parts add up to it) and n the whole micro-batch's real rows."""
    weight_T = real_T.to(scores_TE.dtype)
    weight_TK = weight_T[:, None].expand_as(experts_TK)
    counts_E = torch.zeros(scores_TE.shape[1], dtype=scores_TE.dtype, device=scores_TE.device)
    counts_E = counts_E.index_add(0, experts_TK.flatten(), weight_TK.flatten())
    for group in groups:
        dist.all_reduce(counts_E, group=group)
    T, K = scores_TE.shape[0], experts_TK.shape[1]
    n = counts_E.sum() / K
    loss = load_balancing_loss(scores_TE * weight_T[:, None], counts_E, K)
    return loss * (T / n.clamp(min=1.0)) ** 2, n


def layers_aux_loss(
    scores: RouterScores,
    moes: Mapping[Hashable, nn.Module],
    real_rows: Callable[[int], torch.Tensor],
    groups: tuple[dist.ProcessGroup, ...] = (),
) -> torch.Tensor:
    """sum over the MoE layers `moes` (keyed as in `scores`) of (the layer's balancing loss over its
    real rows, this rank's part when `groups` split the tokens) x (the micro-batch's real rows):
    `real_rows(T)` marks, of the T rows a layer routed in the last forward, those that count. At
    least one layer."""
    terms = []
    for key, moe in moes.items():
        scores_TE = scores.take(key)
        loss, n = real_rows_aux_loss(scores_TE, moe.last_experts_TK, real_rows(scores_TE.shape[0]), groups)
        terms.append(loss * n)
    return torch.stack(terms).sum()


class RouterScores:
    """Keeps the routing scores [T, E] (with their graph) of some MoE layers while `active`."""

    def __init__(self, moes: Mapping[Hashable, nn.Module]) -> None:
        self.active = False
        self.scores: dict[Hashable, torch.Tensor] = {}
        for key, moe in moes.items():
            moe.router.register_forward_hook(self._keeper(key))

    def _keeper(self, key: Hashable):
        def keep(module: nn.Module, args: tuple, out: tuple) -> None:
            if self.active:
                self.scores[key] = out[3]  # Router.forward: (weights_TK, experts_TK, own_TK, scores_TE)

        return keep

    @contextlib.contextmanager
    def recording(self, on: bool = True) -> Iterator[None]:
        """Keep the scores of the forward run inside when `on` (and only then)."""
        self.active = on
        try:
            yield
        finally:
            self.active = False

    def take(self, key: Hashable) -> torch.Tensor:
        return self.scores.pop(key)
