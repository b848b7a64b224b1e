"""The training engine's pipeline-parallel path (parallel.pp > 1): what the engine adds around
`rlloom.parallel.pp.Pipeline`.

- `stage_view`: one module holding this rank's stage parts under the PolicyHead's names
  (`model.tok_embeddings`, `model.layers.7...`, `model.norm`, `model.output`), so the optimizer,
  checkpoints and finiteness checks see one model, the whole model's names on every rank (a pp=2
  checkpoint resumes at pp=1 without renaming).
- `PipeBatch`: the engine's micro-batches (sample indices, None = filler) as the Pipeline's
  `PipeMicroBatch`es, with each one's response mask to spread the K selected logprobs to [b, T].
- `from_last_stage`: metrics computed on the last stage's rank, the same on every pp rank.
- `pipeline_weight_layouts`: the weight layouts of every stage (what `named_weights` yields).
- `merge_moe_metrics`: the MoE load metrics of every pp rank's layers, the same on every pp rank.

Shape legend: K selected positions, b samples of a micro-batch, T response tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rlloom.data.types import RolloutBatch
from rlloom.engines.train.base import WeightLayout
from rlloom.engines.train.native.moe_balance import MoEBalance
from rlloom.engines.train.native.weights import weight_layouts
from rlloom.parallel.pp import Pipeline, stage_module
from rlloom.parallel.pp_batches import PipeMicroBatch

PARTS = ("tok_embeddings", "layers", "norm", "output")


def stage_view(modules: list[nn.Module], model: nn.Module) -> nn.Module:
    """A module whose `model` holds the parts of `modules` (this rank's stages) under the CausalLM's
    attribute names, with the whole model's `args` and `hf_config` (no parameter is copied), and
    beside it a critic's value head as `score` on the last stage's rank (`ValueHead`'s names)."""
    body = nn.Module()
    body.args, body.hf_config = model.args, model.hf_config
    layers = nn.ModuleDict()
    parts: dict[str, nn.Module] = {}
    for module in modules:
        stage = stage_module(module).model
        layers.update(stage.layers)
        for name in ("tok_embeddings", "norm", "output"):
            part = getattr(stage, name)
            if part is not None:
                parts.setdefault(name, part)
    for name in PARTS:  # the CausalLM's order
        if name == "layers":
            body.layers = layers
        elif name in parts:
            setattr(body, name, parts[name])
    view = nn.Module()
    view.model = body
    for module in modules:
        if stage_module(module).score is not None:
            view.score = stage_module(module).score
    return view


@dataclass
class PipeBatch:
    """The engine's micro-batches of one global batch as the Pipeline takes them."""

    rows: list[list[int] | None]
    """Sample indices of each micro-batch (None = a zero-weight filler)."""
    micro_batches: list[PipeMicroBatch | None]
    masks: list[torch.Tensor | None]
    """[b, T] response mask of each micro-batch."""
    num_tokens: list[int]
    """Tokens of each packed micro-batch (before the padding to the budget)."""

    @classmethod
    def of(
        cls, batch: RolloutBatch, rows: list[list[int] | None], *, share_prompts: bool, replay_routes: bool
    ) -> PipeBatch:
        mbs: list[PipeMicroBatch | None] = []
        masks: list[torch.Tensor | None] = []
        num_tokens: list[int] = []
        for mb in rows:
            if mb is None:
                mbs.append(None)
                masks.append(None)
                num_tokens.append(0)
                continue
            packed = batch.select(mb).packed(share_prompts=share_prompts)
            if replay_routes and packed.routes_NLK is None:
                raise ValueError(
                    "algorithm.routing_replay=rollout needs the experts the rollout chose, but a sample has "
                    "no routed_experts (a dense model, or samples not made by the rollout engine). Fix: set "
                    "algorithm.routing_replay=none for this model."
                )
            mask_bT = packed.response_mask_BT
            mbs.append(
                PipeMicroBatch(
                    packed.input_ids_N,
                    packed.position_ids_N,
                    packed.cu_seqlens,
                    packed.max_seqlen,
                    packed.gather_index_BT[mask_bT],
                    packed.target_ids_BT[mask_bT],
                    prefix_lens_S=packed.prefix_lens_S,
                    branch_lens_Z=packed.branch_lens_Z,
                    routes_NLK=packed.routes_NLK,
                )
            )
            masks.append(mask_bT)
            num_tokens.append(packed.input_ids_N.numel())
        return cls(rows, mbs, masks, num_tokens)

    def spread(self, i: int, values_K: torch.Tensor) -> torch.Tensor:
        """fp32 [b, T] of micro-batch `i` with `values_K` at its response positions, 0 elsewhere."""
        mask_bT = self.masks[i]
        flat_K = mask_bT.flatten().nonzero().squeeze(1).to(values_K.device)
        zeros = torch.zeros(mask_bT.numel(), dtype=torch.float32, device=values_K.device)
        return zeros.index_put((flat_K,), values_K.float()).view(mask_bT.shape)


def merge_moe_metrics(
    pipe: Pipeline, metrics: dict[str, float], balance: MoEBalance | None
) -> dict[str, float]:
    """`metrics` with the MoE load metrics of every pp rank's layers (each rank's `MoEBalance.finish`
    covers its own): the per-layer ratios united, their max, and the mean |bias| over all layers."""
    mine = {k: v for k, v in metrics.items() if k.startswith("moe/layer")}
    bias = balance.bias_abs_sum() if balance is not None and "moe/bias_abs_mean" in metrics else (0.0, 0)
    everyone: list[Any] = [None] * pipe.pp
    dist.all_gather_object(everyone, (mine, bias), group=pipe.group)
    layers = {k: v for ratios, _ in everyone for k, v in ratios.items()}
    out = dict(metrics) | layers
    if layers:
        out["moe/load_max_over_mean"] = max(layers.values())
    total, count = (sum(x) for x in zip(*(b for _, b in everyone), strict=True))
    if count:
        out["moe/bias_abs_mean"] = total / count
    return out


def pipeline_weight_layouts(pipe: Pipeline, *, ep: int) -> dict[str, WeightLayout]:
    """`weights.weight_layouts` of every stage of the pipeline, in stage order (as
    `Pipeline.full_weights` yields them; a tied embedding once, as the first stage holds it), on
    every rank of the pp group (collective; a stage's TP shards are those of this rank's tp rank:
    the pp group's ranks share it)."""
    mine = [(s, weight_layouts(stage_module(m).model, ep=ep)) for s, m in zip(pipe.stage_ids, pipe.modules)]
    everyone: list[Any] = [None] * pipe.pp
    dist.all_gather_object(everyone, mine, group=pipe.group)
    out: dict[str, WeightLayout] = {}
    for _, layouts in sorted((item for held in everyone for item in held), key=lambda item: item[0]):
        for name, layout in layouts.items():
            out.setdefault(name, layout)
    return out


def from_last_stage(pipe: Pipeline, value: Any) -> Any:
    """`value` as the last stage's rank of this pp group has it, on every rank of the group."""
    box = [value]
    dist.broadcast_object_list(box, src=pipe.last_rank, group=pipe.group)
    return box[0]
