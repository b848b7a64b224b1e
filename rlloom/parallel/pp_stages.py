"""Pipeline stages: which decoder layers each stage holds, the stage modules cut from the native
CausalLM, and micro-batches padded to one token budget (the runner is `pp.py`).

- `split_layers` assigns contiguous decoder layers to the pp x virtual_stages stages; the first and
  last stage may be given a fixed size (`parallel.pp_first_stage_layers`/`pp_last_stage_layers`,
  as slime's decoder-last-pipeline-num-layers and verl's LAST_LAYER), the others share the rest,
  the embedding and the head each weighing as much as one layer. Stage s runs on pp rank s % pp
  (looped placement, as the interleaved schedules expect).
- `PipelineStageModule` is one stage: the CausalLM modules it holds (the first stage the embedding,
  the last the final norm and the logprob head) under the whole model's parameter names
  (`model.layers.7...`, as the engine's PolicyHead), so checkpoints and optimizers see one model.
- `pad_to_budget`: pipelining fixes activation shapes when it first runs, so every micro-batch is
  the packed stream plus one padding segment (attending only to itself) up to the budget; under
  context parallelism each cp rank keeps an equal share of it (budget / cp tokens, `cp.fixed_shares`).

Shape legend: N tokens of a micro-batch, P the token budget, K selected positions, D hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from rlloom.models.args import ModelArgs
from rlloom.models.attention_ops import AttnLayout, TreePlan
from rlloom.models.logprobs import token_logprobs
from rlloom.parallel.cp import CPShard, check_cp_layout, fixed_shares
from rlloom.parallel.vocab_parallel import vocab_parallel_token_logprobs

SCHEDULE_NAMES = ("1f1b", "interleaved", "zero_bubble")


def split_layers(
    num_layers: int,
    num_stages: int,
    *,
    first_stage_layers: int = 0,
    last_stage_layers: int = 0,
    embed_weight: int = 1,
    head_weight: int = 1,
) -> list[range]:
    """Contiguous decoder-layer ranges of `num_stages` stages (pp x virtual stages).

    A non-zero `first_stage_layers`/`last_stage_layers` fixes that stage's size; every other stage
    starts with one layer and each further layer goes to the stage of lowest cost (its layers, plus
    `embed_weight` on stage 0 and `head_weight` on the last stage), ties to the earliest stage.
    E.g. 61 layers over 4 stages with the last holding 13: [0, 16), [16, 32), [32, 48), [48, 61).
    """
    for name, value in (
        ("pp_first_stage_layers", first_stage_layers),
        ("pp_last_stage_layers", last_stage_layers),
    ):
        if value < 0:
            raise ValueError(
                f"parallel.{name}={value} is invalid: must be >= 0 (0 = even split). Fix: use 0."
            )
    if num_stages < 1 or num_layers < num_stages:
        raise ValueError(
            f"{num_stages} pipeline stages (parallel.pp x parallel.pp_virtual_stages) need at least one decoder "
            f"layer each, but the model has {num_layers}. Fix: lower parallel.pp or parallel.pp_virtual_stages."
        )
    counts = [0] * num_stages
    if num_stages == 1:
        if first_stage_layers or last_stage_layers:
            raise ValueError(
                "parallel.pp_first_stage_layers / pp_last_stage_layers need at least 2 pipeline stages. Fix: set "
                "them to 0 or raise parallel.pp."
            )
        return [range(num_layers)]
    counts[0], counts[-1] = first_stage_layers, last_stage_layers
    free = [s for s, n in enumerate(counts) if n == 0]
    remaining = num_layers - sum(counts)
    if remaining < len(free) or (not free and remaining):
        raise ValueError(
            f"parallel.pp_first_stage_layers={first_stage_layers} and pp_last_stage_layers={last_stage_layers} "
            f"leave {remaining} of the model's {num_layers} layers for the other {len(free)} stages (rule: every "
            "stage holds at least one layer and all layers are placed). Fix: change them so that they do."
        )
    extra = [0] * num_stages
    extra[0] += embed_weight
    extra[-1] += head_weight
    for s in free:
        counts[s] = 1
    for _ in range(remaining - len(free)):
        counts[min(free, key=lambda s: (counts[s] + extra[s], s))] += 1
    bounds = [0]
    for n in counts:
        bounds.append(bounds[-1] + n)
    return [range(bounds[s], bounds[s + 1]) for s in range(num_stages)]


def rank_stages(pp_rank: int, pp: int, virtual_stages: int) -> list[int]:
    """Stage indices pp rank `pp_rank` runs (looped placement: stage s on rank s % pp)."""
    return list(range(pp_rank, pp * virtual_stages, pp))


class StageModel(nn.Module):
    """The part of a CausalLM one stage holds, under the CausalLM's attribute names; absent parts are None.

    With tied embeddings the last stage holds `tok_embeddings` too, as its lm head: both copies start
    equal, `Pipeline.clip_grad_norm_` sums their gradients, so they stay equal (as Megatron does).
    """

    def __init__(self, model: nn.Module, layer_ids: range, *, is_first: bool, is_last: bool) -> None:
        super().__init__()
        self.args = model.args
        self.hf_config = model.hf_config
        self.tied = model.output is None
        """The whole model ties its lm head to the token embedding."""
        self.tok_embeddings = model.tok_embeddings if is_first or (is_last and self.tied) else None
        self.rope = type(model.rope)(model.args.rope)  # no parameters; one per stage, buffers rebuilt
        self.rope.init_buffers()
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layer_ids})
        sparse = [i for i, layer in enumerate(model.layers) if getattr(layer, "moe", None) is not None]
        self.moe_index = {str(i): sparse.index(i) for i in layer_ids if i in sparse}
        """Layer key -> its index among the whole model's MoE layers (the routes' middle axis)."""
        self.norm = model.norm if is_last else None
        self.output = model.output if is_last else None

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """[V, D] weight of the lm head (the token embedding when tied); last stage only."""
        return self.tok_embeddings.weight if self.output is None else self.output.weight


@dataclass
class PipeMicroBatch:
    """One micro-batch as the caller packed it (unpadded; CPU or device tensors)."""

    input_ids_N: torch.Tensor
    position_ids_N: torch.Tensor
    cu_seqlens: torch.Tensor
    """[S + 1] int32."""
    max_seqlen: int
    positions_K: torch.Tensor
    """[K] int64 positions whose next token is scored."""
    targets_K: torch.Tensor
    """[K] int64 the scored tokens."""
    prefix_lens_S: torch.Tensor | None = None
    """Shared-prompt layout (as `PackedTensors`): [S] prompt length opening each segment, or None."""
    branch_lens_Z: torch.Tensor | None = None
    """Shared-prompt layout: [Z] non-empty branch lengths in stream order, or None."""
    routes_NLK: torch.Tensor | None = None
    """[N, MoE layers, K] experts the rollout chose per position (-1 = none), or None."""


@dataclass
class PaddedMicroBatch:
    """A micro-batch padded to the budget, on the device: one padding segment after the real tokens."""

    input_ids_1P: torch.Tensor
    position_ids_P: torch.Tensor
    layout: AttnLayout
    positions_K: torch.Tensor
    targets_K: torch.Tensor
    routes_PLK: torch.Tensor | None
    real: bool
    cp: CPShard | None = None
    """Context parallelism: this rank's share of the padded stream (budget / cp tokens); the ids,
    positions and routes above are then this rank's rows, the attention is the shard's, and
    positions_K/targets_K stay the whole micro-batch's."""
    mine_K: torch.Tensor | None = None
    """Under CP: [K] bool, the selected positions this rank holds (k of them)."""
    local_k: torch.Tensor | None = None
    """Under CP: [k] those positions in this rank's tokens (selected on the host: no device sync)."""
    local_targets_k: torch.Tensor | None = None
    """Under CP: [k] their target tokens."""


def pad_to_budget(
    mb: PipeMicroBatch | None, budget: int, device: torch.device, cp_group: dist.ProcessGroup | None = None
) -> PaddedMicroBatch:
    """`mb` padded with a segment of its own up to `budget` tokens; None gives an all-padding filler.
    With `cp_group` (context parallelism) the padded stream is cut into equal shares
    (`cp.fixed_shares`) and this rank keeps its own."""
    if mb is None:
        empty = torch.zeros(0, dtype=torch.int64)
        mb = PipeMicroBatch(empty, empty, torch.zeros(1, dtype=torch.int32), 0, empty, empty)
    n = mb.input_ids_N.numel()
    if n > budget:
        raise ValueError(
            f"a micro-batch has {n} tokens but train.max_tokens_per_micro_batch={budget}; under pipeline "
            "parallelism every micro-batch is padded to that budget, so no sample may exceed it. Fix: raise "
            f"train.max_tokens_per_micro_batch to at least {n} (the longest prompt + response)."
        )
    pad = budget - n
    ids = torch.cat([mb.input_ids_N.cpu(), torch.zeros(pad, dtype=torch.int64)])
    pos = torch.cat([mb.position_ids_N.cpu(), torch.arange(pad)])
    cu = mb.cu_seqlens.cpu().to(torch.int32)
    prefix = mb.prefix_lens_S
    routes = mb.routes_NLK
    if pad:  # the padding segment: a causal sequence of its own (a prompt without branches)
        cu = torch.cat([cu, torch.tensor([budget], dtype=torch.int32)])
        prefix = None if prefix is None else torch.cat([prefix.cpu(), prefix.new_tensor([pad]).cpu()])
        routes = (
            None if routes is None else torch.cat([routes, routes.new_full((pad, *routes.shape[1:]), -1)])
        )
    layout = AttnLayout(kind="packed", cu_seqlens=cu.to(device), max_seqlen=max(mb.max_seqlen, pad))
    if prefix is not None and mb.branch_lens_Z is not None:
        tree = TreePlan(cu, prefix, mb.branch_lens_Z.cpu(), device)  # built on the host: no syncs
        if tree.has_branches:
            layout = AttnLayout(
                kind="tree", cu_seqlens=layout.cu_seqlens, max_seqlen=layout.max_seqlen, tree=tree
            )
    if cp_group is None:
        return PaddedMicroBatch(
            ids.view(1, budget).to(device),
            pos.to(device),
            layout,
            mb.positions_K.to(device),
            mb.targets_K.to(device),
            None if routes is None else routes.to(device),
            real=n > 0,
        )
    check_cp_layout(dist.get_world_size(cp_group), prefix is not None)
    lens = (cu[1:] - cu[:-1]).tolist()
    shares = fixed_shares(lens, dist.get_world_size(cp_group), padded=pad > 0)
    shard = CPShard(cu, group=cp_group, device=device, shares=shares)
    mine_K, local_K = shard.localize(mb.positions_K.cpu())
    targets_K = mb.targets_K.cpu()
    return PaddedMicroBatch(
        shard.take(ids).view(1, -1).to(device),
        shard.take(pos).to(device),
        AttnLayout(kind="backend", backend=shard),
        mb.positions_K.to(device),
        mb.targets_K.to(device),
        None if routes is None else shard.take(routes).to(device),
        real=n > 0,
        cp=shard,
        mine_K=mine_K.to(device),
        local_k=local_K[mine_K].to(device),
        local_targets_k=targets_K[mine_K].to(device),
    )


@dataclass
class StageFeed:
    """What the stages of one schedule step read: the padded micro-batches and the head's settings."""

    micro_batches: list[PaddedMicroBatch] = field(default_factory=list)
    temperature: float = 1.0
    with_entropy: bool = False
    replay_routes: bool = False
    """MoE: use the micro-batches' routes (routing replay) instead of only comparing them."""


class PipelineStageModule(nn.Module):
    """One stage: forward(x, mb) with x the token ids [1, P] (first stage) or hidden states [1, P, D];
    returns hidden states [1, P, D], or on the last stage [1, 2, P] fp32: logprobs then entropies
    of the K selected positions in slots [:K], 0 after."""

    def __init__(
        self, model: StageModel, *, is_first: bool, is_last: bool, chunk_tokens: int, fused_head: bool
    ):
        super().__init__()
        self.model = model
        self.is_first, self.is_last = is_first, is_last
        self.chunk_tokens, self.fused_head = chunk_tokens, fused_head
        self.feed = StageFeed()

    def forward(self, x: torch.Tensor, mb: int) -> torch.Tensor:
        batch = self.feed.micro_batches[mb]
        h = self.model.tok_embeddings(x[0]) if self.is_first else x[0]
        cos, sin = self.model.rope(batch.position_ids_P, h.dtype)
        for key, layer in self.model.layers.items():
            moe_index = self.model.moe_index.get(key)
            if moe_index is not None and batch.routes_PLK is not None:
                h = layer(h, cos, sin, batch.layout, batch.routes_PLK[:, moe_index], self.feed.replay_routes)
            else:
                h = layer(h, cos, sin, batch.layout)
        if not self.is_last:
            # Not a view: zero-bubble schedules detach a stage's outputs in place after the input backward.
            # Under TP this is the rank's token shard [1, P/tp, D] (a plain tensor: the residual stream).
            return _local(h).unsqueeze(0).clone()
        return self._head(self.model.norm(h), batch)

    def _head(self, hidden_PD: torch.Tensor, batch: PaddedMicroBatch) -> torch.Tensor:
        positions_K, targets_K = batch.positions_K, batch.targets_K
        total = positions_K.numel()
        if batch.cp is not None:  # this rank's selected positions, in its own tokens
            positions_K, targets_K = batch.local_k, batch.local_targets_k
        num_selected = positions_K.numel()
        if num_selected == 0:  # one position, kept connected to every parameter with weight 0
            positions_K, targets_K = positions_K.new_zeros(1), targets_K.new_zeros(1)
        weight_VD = self.model.lm_head_weight
        head = dict(temperature=self.feed.temperature, chunk_tokens=self.chunk_tokens)
        if isinstance(weight_VD, DTensor):  # TP: gather the token shards, vocabulary-parallel head
            if isinstance(hidden_PD, DTensor):
                hidden_PD = hidden_PD.redistribute(hidden_PD.device_mesh, [Replicate()]).to_local()
            logp_K, entropy_K = vocab_parallel_token_logprobs(
                hidden_PD[positions_K], weight_VD, targets_K, with_entropy=self.feed.with_entropy, **head
            )
        else:
            logp_K, entropy_K = token_logprobs(
                hidden_PD[positions_K],
                weight_VD,
                targets_K,
                with_entropy=self.feed.with_entropy,
                fused=self.fused_head,
                **head,
            )
        if entropy_K is None:
            entropy_K = torch.zeros_like(logp_K)
        values_2K = torch.stack([logp_K, entropy_K]) * (1.0 if num_selected else 0.0)
        if batch.cp is not None:  # every cp rank gets the whole micro-batch's (backward: its own)
            keep = values_2K.sum() * 0.0  # connected to every parameter even with nothing selected here
            values_2K = batch.cp.gather_selected(values_2K[:, :num_selected].T, batch.mine_K).T + keep
        out_12P = hidden_PD.new_zeros(1, 2, self.budget_of(hidden_PD, batch), dtype=torch.float32)
        out_12P[0, :, :total] = values_2K
        return out_12P

    @staticmethod
    def budget_of(hidden_PD: torch.Tensor, batch: PaddedMicroBatch) -> int:
        """Tokens of the whole padded micro-batch (under CP this rank holds budget / cp of them)."""
        return hidden_PD.shape[0] if batch.cp is None else batch.cp.num_tokens


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def check_pp(args: ModelArgs, pp: int, schedule: str, virtual_stages: int) -> None:
    """ValueError naming the first pipeline setting the model or the schedule cannot take."""
    if schedule not in SCHEDULE_NAMES:
        raise ValueError(
            f"parallel.pp_schedule={schedule!r} is invalid: must be one of {', '.join(SCHEDULE_NAMES)}. Fix: pick one."
        )
    if virtual_stages < 1:
        raise ValueError(f"parallel.pp_virtual_stages={virtual_stages} is invalid: must be >= 1. Fix: use 1.")
    if schedule == "1f1b" and virtual_stages != 1:
        raise ValueError(
            f"parallel.pp_schedule=1f1b runs one stage per rank, but parallel.pp_virtual_stages={virtual_stages}. "
            "Fix: use pp_schedule=interleaved (or zero_bubble) for virtual stages, or pp_virtual_stages=1."
        )
    if args.num_layers < pp * virtual_stages:
        raise ValueError(
            f"parallel.pp={pp} x parallel.pp_virtual_stages={virtual_stages} = {pp * virtual_stages} stages, but the "
            f"model has {args.num_layers} layers (rule: at least one per stage). Fix: lower them."
        )


def check_budget(budget: int, shares: int) -> None:
    """ValueError unless the micro-batch token budget splits into `shares` (cp x tp) equal token shares."""
    if budget < 1 or budget % shares:
        raise ValueError(
            f"train.max_tokens_per_micro_batch={budget} is invalid with parallel.pp > 1: every micro-batch is "
            f"padded to this budget and split into parallel.cp x parallel.tp = {shares} equal token shares, so it "
            f"must be a positive multiple of {shares}. Fix: set it to {max(shares, -(-budget // shares) * shares)}."
        )
