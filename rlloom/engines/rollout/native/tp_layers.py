"""The layers of a tensor-parallel rollout model that talk to the other ranks (tensor_parallel.py puts
them in place of the full model's): a row-parallel linear, a vocabulary-parallel embedding and a MoE
layer that all-reduces once after combining its experts. Each holds its process group; every
collective is an in-place `dist.all_reduce`, which torch.compile's Dynamo rewrites into a functional
collective and which, with NCCL, a CUDA graph can capture (the decode forward of cuda_graphs.py; that
GPU path has not been run yet)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from rlloom.models.moe import MoE


class RowParallelLinear(nn.Linear):
    """y = all_reduce(x_local @ W_local^T) + b: the input features split over the group, the bias
    (replicated) added once after the sum."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: dist.ProcessGroup) -> None:
        super().__init__(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
        self.weight = nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            self.bias = nn.Parameter(bias.clone(), requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Rows [start, start + Vp) of the embedding; ids elsewhere look up zeros, and an all-reduce
    sums the ranks' lookups into the full embedding."""

    def __init__(self, weight: torch.Tensor, start: int, group: dist.ProcessGroup) -> None:
        super().__init__(weight.shape[0], weight.shape[1], device="meta")
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start = start
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        h = F.embedding(torch.where(mine, local, 0), self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        dist.all_reduce(h, group=self.group)
        return h


class ReducedMoE(MoE):
    """A MoE layer whose experts hold a slice of every expert's width: one all-reduce of the combined
    (routed + shared) output. Installed by class swap, so routes and counts stay where they were."""

    group: dist.ProcessGroup

    def forward(
        self, x: torch.Tensor, routes_TK: torch.Tensor | None = None, replay: bool = False
    ) -> torch.Tensor:
        out = super().forward(x, routes_TK, replay)
        dist.all_reduce(out, group=self.group)
        return out
