"""Pipeline stages: which decoder layers each stage holds and the stage modules cut from the native
CausalLM (their micro-batches are `pp_batches.py`'s, the runner is `pp.py`).

- `split_layers` assigns contiguous decoder layers to the pp x virtual_stages stages; the first and
  last stage may be given a fixed size (`parallel.pp_first_stage_layers`/`pp_last_stage_layers`,
  as slime's decoder-last-pipeline-num-layers and verl's LAST_LAYER), the others share the rest,
  the embedding and the head each weighing as much as one layer. Stage s runs on pp rank s % pp
  (looped placement, as the interleaved schedules expect).
- `PipelineStageModule` is one stage: the CausalLM modules it holds (the first stage the embedding,
  the last the final norm and the logprob head) under the whole model's parameter names
  (`model.layers.7...`, as the engine's PolicyHead), so checkpoints and optimizers see one model.
- The micro-batches the stages run, padded to one token budget, are `pp_batches.py`'s.

Shape legend: N tokens of a micro-batch, P the token budget, K selected positions, D hidden size.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from rlloom.models.args import ModelArgs
from rlloom.models.logprobs import token_logprobs
from rlloom.parallel.pp_aux import AttachAuxLoss, RouterScores, layers_aux_loss
from rlloom.parallel.pp_batches import PaddedMicroBatch, StageFeed
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
    A value model (`value_model`: PPO's critic, its lm head dropped) has no lm head to tie.
    """

    def __init__(
        self, model: nn.Module, layer_ids: range, *, is_first: bool, is_last: bool, value_model: bool = False
    ) -> None:
        super().__init__()
        self.args = model.args
        self.hf_config = model.hf_config
        self.tied = model.output is None and not value_model
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


class PipelineStageModule(nn.Module):
    """One stage: forward(x, mb) with x the token ids [1, P] (first stage) or hidden states [1, P, D];
    returns hidden states [1, P, D], or on the last stage [1, 2, P] fp32: logprobs then entropies
    of the K selected positions in slots [:K], 0 after. The last stage of a value model (`score`:
    the critic's linear value head, [D] -> 1, named as `ValueHead`'s) gives values in place of the
    logprobs, and entropies 0."""

    def __init__(
        self,
        model: StageModel,
        *,
        is_first: bool,
        is_last: bool,
        chunk_tokens: int,
        fused_head: bool,
        score: nn.Linear | None = None,
    ):
        super().__init__()
        self.model = model
        self.score = score if is_last else None
        self.is_first, self.is_last = is_first, is_last
        self.chunk_tokens, self.fused_head = chunk_tokens, fused_head
        self.feed = StageFeed()
        self.router_scores = RouterScores({key: model.layers[key].moe for key in model.moe_index})
        """The MoE auxiliary loss's routing scores, kept during this stage's forward when it is on."""

    def forward(self, x: torch.Tensor, mb: int) -> torch.Tensor:
        batch = self.feed.micro_batches[mb]
        h = self.model.tok_embeddings(x[0]) if self.is_first else x[0]
        cos, sin = self.model.rope(batch.position_ids_P, h.dtype)
        with_aux = self.feed.aux_loss_sum is not None and batch.real and bool(self.model.moe_index)
        with self.router_scores.recording(with_aux):
            for key, layer in self.model.layers.items():
                moe_index = self.model.moe_index.get(key)
                if moe_index is not None and batch.routes_PLK is not None:
                    routes = batch.routes_PLK[:, moe_index]
                    h = layer(h, cos, sin, batch.layout, routes, self.feed.replay_routes)
                else:
                    h = layer(h, cos, sin, batch.layout)
        aux = self._aux_loss(batch) if with_aux else None
        if self.feed.moe_loads is not None:
            self._record_loads(batch)
        if self.feed.route_counts_M2 is not None and batch.routes_PLK is not None:
            for key in self.model.moe_index:
                self.feed.route_counts_M2[mb] += self.model.layers[key].moe.last_route_mismatch
        if not self.is_last:
            # Not a view: zero-bubble schedules detach a stage's outputs in place after the input backward.
            # Under TP this is the rank's token shard [1, P/tp, D] (a plain tensor: the residual stream).
            h = _local(h)
            return (h if aux is None else AttachAuxLoss.apply(h, aux)).unsqueeze(0).clone()
        out_12P = self._head(self.model.norm(h), batch)
        return out_12P if aux is None else AttachAuxLoss.apply(out_12P, aux).clone()

    def _padding_rows(self, batch: PaddedMicroBatch, num_rows: int) -> torch.Tensor:
        """[num_rows] bool: which rows an MoE layer of this stage routed are padding."""
        padding_T = batch.padding_L
        if padding_T.shape[0] != num_rows:  # each TP rank routed its own token shard
            padding_T = padding_T.view(-1, num_rows)[self.feed.tp_rank]
        return padding_T

    def _real_rows(self, batch: PaddedMicroBatch, num_rows: int) -> torch.Tensor:
        return ~self._padding_rows(batch, num_rows)

    def _aux_loss(self, batch: PaddedMicroBatch) -> torch.Tensor:
        """coef x sum over this stage's MoE layers of (the layer's balancing loss over the real
        tokens) x (those tokens) x `feed.aux_token_weight`: its part of the one-process engine's
        coef x token share x mean over layers (`pp_aux.py`); adds it, detached and without the
        coefficient, to `feed.aux_loss_sum`."""
        moes = {key: self.model.layers[key].moe for key in self.model.moe_index}
        real_rows = functools.partial(self._real_rows, batch)
        term = layers_aux_loss(self.router_scores, moes, real_rows, self.feed.token_groups)
        term = term * self.feed.aux_token_weight
        self.feed.aux_loss_sum += term.detach()
        return term * self.feed.aux_loss_coef

    def _record_loads(self, batch: PaddedMicroBatch) -> None:
        """Add each MoE layer's expert loads of this forward, less the padding's, to the feed (no
        host sync). Read right after the stage's forward: a recompute under activation
        checkpointing (in backward) overwrites the layers' last counts, and counts nothing here."""
        loads = self.feed.moe_loads
        for key in self.model.moe_index:
            moe = self.model.layers[key].moe  # checkpoint/compile wrappers pass attributes through
            experts_TK, counts_E = moe.last_experts_TK, moe.last_token_counts
            padding_T = self._padding_rows(batch, experts_TK.shape[0])
            weight_TK = padding_T[:, None].expand_as(experts_TK).to(counts_E.dtype)
            padded_E = torch.zeros_like(counts_E).index_add_(0, experts_TK.flatten(), weight_TK.flatten())
            loads[key] = counts_E - padded_E + loads.get(key, 0)

    def _head(self, hidden_PD: torch.Tensor, batch: PaddedMicroBatch) -> torch.Tensor:
        positions_K, targets_K = batch.positions_K, batch.targets_K
        if batch.cp is not None:  # this rank's selected positions, in its own tokens
            positions_K, targets_K = batch.local_k, batch.local_targets_k
        num_selected = positions_K.numel()
        if num_selected == 0:  # one position, kept connected to every parameter with weight 0
            positions_K, targets_K = positions_K.new_zeros(1), targets_K.new_zeros(1)
        if isinstance(hidden_PD, DTensor):  # TP: gather the token shards (every TP rank runs all K)
            hidden_PD = hidden_PD.redistribute(hidden_PD.device_mesh, [Replicate()]).to_local()
        if self.score is not None:  # a value model: the replicated value head
            logp_K, entropy_K = self.score(hidden_PD[positions_K]).squeeze(-1).float(), None
        elif isinstance(self.model.lm_head_weight, DTensor):  # TP: the vocabulary-parallel head
            logp_K, entropy_K = vocab_parallel_token_logprobs(
                hidden_PD[positions_K],
                self.model.lm_head_weight,
                targets_K,
                with_entropy=self.feed.with_entropy,
                temperature=self.feed.temperature,
                chunk_tokens=self.chunk_tokens,
            )
        else:
            logp_K, entropy_K = token_logprobs(
                hidden_PD[positions_K],
                self.model.lm_head_weight,
                targets_K,
                with_entropy=self.feed.with_entropy,
                fused=self.fused_head,
                temperature=self.feed.temperature,
                chunk_tokens=self.chunk_tokens,
            )
        if entropy_K is None:
            entropy_K = torch.zeros_like(logp_K)
        values_2K = torch.stack([logp_K, entropy_K]) * (1.0 if num_selected else 0.0)
        if batch.cp is not None:  # every cp rank gets the whole micro-batch's (backward: its own)
            keep = values_2K.sum() * 0.0  # connected to every parameter even with nothing selected here
            values_2K = batch.cp.gather_selected(values_2K[:, :num_selected].T, batch.mine_K).T + keep
        budget = hidden_PD.shape[0] if batch.cp is None else batch.cp.num_tokens  # CP: a 1/cp share here
        out_12P = hidden_PD.new_zeros(1, 2, budget, dtype=torch.float32)
        out_12P[0, :, : values_2K.shape[1]] = values_2K  # [:1] with nothing selected and no CP: weight 0
        return out_12P


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


ZERO_BUBBLE_MIN_TORCH = (2, 13)
"""torch 2.11 and 2.12's zero-bubble weight backward fails (`_input_metadata` is invalid) when a stage's
graph holds a custom autograd function, as rlloom's logprob head is: seen with both wheels on the CPU."""


def zero_bubble_supported(torch_version: str) -> bool:
    """Whether this torch's zero-bubble schedule runs rlloom's stages (`torch.__version__`, e.g. "2.13.0+cpu")."""
    major, minor = (int(part) for part in torch_version.split("+")[0].split(".")[:2])
    return (major, minor) >= ZERO_BUBBLE_MIN_TORCH


def check_pp(args: ModelArgs, pp: int, schedule: str, virtual_stages: int) -> None:
    """ValueError naming the first pipeline setting the model or the schedule cannot take."""
    if schedule not in SCHEDULE_NAMES:
        raise ValueError(
            f"parallel.pp_schedule={schedule!r} is invalid: must be one of {', '.join(SCHEDULE_NAMES)}. Fix: pick one."
        )
    if schedule == "zero_bubble" and not zero_bubble_supported(torch.__version__):
        need = ".".join(map(str, ZERO_BUBBLE_MIN_TORCH))
        raise ValueError(
            f"parallel.pp_schedule=zero_bubble needs torch >= {need}, but torch is {torch.__version__} (its "
            "zero-bubble weight backward fails on custom autograd functions such as rlloom's logprob head). "
            f"Fix: use parallel.pp_schedule=1f1b or interleaved, or install torch >= {need}."
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
