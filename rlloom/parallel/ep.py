"""Expert parallelism: each of the `ep` ranks holds E / ep of a MoE layer's routed experts, and every
token-expert pair travels to the rank that holds its expert and back (GShard, Lepikhin et al. 2020).

Per MoE layer, on the tokens of this rank (router and shared experts run locally as before):
1. dispatch: sort the T x K token-expert pairs by expert, so each destination rank's pairs are one
   contiguous run; exchange the per-expert counts first (an all-to-all of ep x E/ep integers), then
   the tokens with uneven splits (an all-to-all with autograd). Received tokens arrive grouped by
   source rank, then by local expert.
2. compute: the model's own `GroupedExperts` runs on the received tokens against the local experts
   (one slice per expert: grouped GEMM on CUDA/bf16, a loop elsewhere); an expert that received no
   token is skipped.
3. combine: the outputs go back by the reverse all-to-all and are summed into their tokens with the
   routing weights, exactly as the one-process layer does.

`apply_ep(model, ep_mesh)` keeps on each rank only its slice of the stacked expert weights (plain
parameters [E / ep, ...]; `experts.ep_range` records which global experts they are) and wraps the
expert modules' inputs and outputs with the dispatch and combine. A local expert's gradient is the
sum over the tokens of every EP rank that chose it, as on one process over the whole batch.
The EP ranks are data-parallel ranks (ep is carved from dp_shard x cp x tp, see `dims.py`): the
non-expert parameters' gradients still need the data-parallel reduction (FSDP does it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh

from rlloom.models.moe import GroupedExperts, combine_rows, dispatch_rows, inverse_permutation


@dataclass(slots=True)
class Dispatch:
    """How one forward's tokens were sent, kept for the combine."""

    order_P: torch.Tensor
    """[P] the token-expert pairs (pair t*K + k) in send order, sorted by expert (P = T x K)."""
    inverse_P: torch.Tensor
    """[P] `inverse_permutation(order_P)`."""
    weights_TK: torch.Tensor
    """[T, K] routing weights, fp32."""
    send_counts: list[int]
    """Pairs sent to each EP rank."""
    recv_counts: list[int]
    """Tokens received from each EP rank."""
    counts_E: torch.Tensor
    """[E] this rank's tokens per global expert (the one-process layer's token counts)."""


def _exchange_counts(counts_E: torch.Tensor, ep: int, group: dist.ProcessGroup) -> torch.Tensor:
    """[ep, E/ep] tokens each source rank sends to each of this rank's experts."""
    recv = torch.empty_like(counts_E)
    dist.all_to_all_single(recv, counts_E, group=group)
    return recv.view(ep, -1)


def dispatch(
    x_TD: torch.Tensor,
    weights_TK: torch.Tensor,
    experts_TK: torch.Tensor,
    num_experts: int,
    ep: int,
    group: dist.ProcessGroup,
) -> tuple[torch.Tensor, torch.Tensor, Dispatch]:
    """Send each token-expert pair to the rank of its expert -> (received x [R, D], local expert of
    each received token [R], the record for `combine`)."""
    K = experts_TK.shape[1]
    flat_P = experts_TK.flatten()
    order_P = torch.argsort(flat_P, stable=True)
    inverse_P = inverse_permutation(order_P)
    counts_E = torch.bincount(flat_P, minlength=num_experts)
    recv_ER = _exchange_counts(counts_E, ep, group)  # counts first: the receive sizes
    # One host read for both split lists (the collective needs them on the host; each read waits for
    # the device), and the receive size given to repeat_interleave so it need not read it again.
    counts = torch.cat([counts_E.view(ep, -1).sum(dim=1), recv_ER.sum(dim=1)]).tolist()
    send_counts, recv_counts = counts[:ep], counts[ep:]
    x_R = all_to_all_single_autograd(
        dispatch_rows(x_TD, order_P, inverse_P, K), recv_counts, send_counts, group
    )
    local_R = torch.repeat_interleave(
        torch.arange(num_experts // ep, device=x_TD.device).repeat(ep),
        recv_ER.flatten(),
        output_size=sum(recv_counts),
    )
    record = Dispatch(
        order_P=order_P,
        inverse_P=inverse_P,
        weights_TK=weights_TK,
        send_counts=send_counts,
        recv_counts=recv_counts,
        counts_E=counts_E,
    )
    return x_R, local_R, record


def combine(y_RD: torch.Tensor, record: Dispatch, group: dist.ProcessGroup) -> torch.Tensor:
    """Return each received token's expert output to its sender and sum it into its token with the
    routing weight -> [T, D]."""
    y_PD = all_to_all_single_autograd(y_RD, record.send_counts, record.recv_counts, group)
    return combine_rows(y_PD, record.inverse_P, record.weights_TK)


class _ExpertParallel:
    """Forward pre-hook and hook around one `GroupedExperts` (see the module docstring)."""

    def __init__(self, num_experts: int, ep: int, group: dist.ProcessGroup) -> None:
        self.num_experts, self.ep, self.group = num_experts, ep, group
        self.record: Dispatch | None = None
        self.x_R: torch.Tensor | None = None

    def input_fn(self, _module: nn.Module, inputs: tuple) -> tuple:
        x_TD, weights_TK, experts_TK = inputs
        x_R, local_R, self.record = dispatch(
            x_TD, weights_TK, experts_TK, self.num_experts, self.ep, self.group
        )
        self.x_R = x_R
        # Each received token goes to one local expert with weight 1; the routing weight is applied
        # in `combine`, on the sender.
        return x_R, torch.ones(x_R.shape[0], 1, dtype=torch.float32, device=x_R.device), local_R.unsqueeze(-1)

    def output_fn(self, module: nn.Module, _inputs: tuple, outputs: tuple) -> tuple:
        y_RD, _local_counts = outputs
        record, x_R, self.record, self.x_R = self.record, self.x_R, None, None
        assert record is not None
        if x_R.shape[0] == 0 and torch.is_grad_enabled():
            # No token reached this rank's experts, so nothing connects the output to the received
            # tokens or the local experts. Connect them (adding zero): this rank still takes part in
            # the backward all-to-alls the other ranks wait for, and its experts get zero gradients
            # (as unused experts do on one process) instead of none, which an optimizer would skip.
            y_RD = y_RD + 0 * sum((t.sum() for t in (x_R, *module.parameters())), x_R.new_zeros(()))
        return combine(y_RD, record, self.group), record.counts_E


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> int:
    """Split the routed experts of every MoE layer of `model` over the 1-D `ep_mesh` in place;
    returns the number of layers changed."""
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    layers = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    for experts in layers:
        num_experts = experts.w1.shape[0]
        if num_experts % ep:
            raise ValueError(
                f"apply_ep: ep={ep} does not divide num_experts={num_experts}. Fix: use an ep that divides it."
            )
        per_rank = num_experts // ep
        start, end = rank * per_rank, (rank + 1) * per_rank
        for name in ("w1", "w2", "w3"):
            full = getattr(experts, name)
            setattr(
                experts,
                name,
                nn.Parameter(full.detach()[start:end].clone(), requires_grad=full.requires_grad),
            )
        experts.ep_range = (start, end)
        style = _ExpertParallel(num_experts, ep, ep_mesh.get_group())
        experts.register_forward_pre_hook(style.input_fn)
        experts.register_forward_hook(style.output_fn)
    return len(layers)
