"""Pipeline parallelism: the native model cut into stages, run by a torch.distributed.pipelining schedule.

- `apply_pp` cuts this rank's stages from the model (`pp_stages.py`: uneven first/last stages,
  virtual stages), lets the caller parallelise each stage module, and returns them with the runner.
- `Pipeline` runs a schedule ("1f1b", "interleaved", "zero_bubble") over micro-batches padded to
  ONE token budget: pipelining fixes activation shapes when it first runs, so every micro-batch is
  the packed stream plus a padding segment up to the budget. The last stage writes the K selected
  logprobs (and entropies) into a fixed [1, 2, budget] output; the caller's loss function gets
  them per micro-batch and returns that micro-batch's loss sum divided by the GLOBAL normaliser
  (no per-micro-batch or per-stage rescaling: the schedule runs with scale_grads=False).

How the training engine plugs it in (per rank, after `ParallelDims.build_mesh`; the engine does it
through `rlloom.parallel.parallelize.parallelize_pp` and `rlloom.engines.train.native.pipeline`):

    stages, pipe = apply_pp(model, dims.pp_mesh(), schedule=par.schedule, virtual_stages=par.pp_virtual_stages,
                            first_stage_layers=par.pp_first_stage_layers, last_stage_layers=par.pp_last_stage_layers,
                            budget=cfg.max_tokens_per_micro_batch, device=device, dtype=compute_dtype,
                            parallelize_stage=lambda m: apply_fsdp(m, dims.dp_shard_mesh(), ...,
                                                                   reshard_after_forward=False, layers_of=m.model))
    # optimizer over the parameters of `stages` (names as PolicyHead's: "model.layers.7...");
    # per step, this dp rank's micro-batches from plan_rank (equal counts on every dp rank), each
    # `batch.select(mb).packed(share_prompts)` as a PipeMicroBatch (positions/targets: the response
    # mask's gather_index_BT/target_ids_BT), None for a filler:
    losses_M = pipe.forward_backward(mbs, loss_fn)  # loss_fn(i, logp_K, entropy_K): spread logp_K to [b, T]
                                                    # with the mask, loss_sum_i / global normaliser
    norm = pipe.clip_grad_norm_(cfg.grad_clip)      # once per optimizer step, before the step
    logps = pipe.forward_logprobs(mbs, temperature=..., with_entropy=...)  # [(logp_K, entropy_K)], every pp rank

`loss_fn` runs on the last stage's rank only: metrics it returns must be reduced there and
broadcast over the pp group. Weight sync: `Pipeline.full_weights()` gives every rank the whole
model under the CausalLM's names (for the Hugging Face adapter); with `tp_local_shards` each
tensor-parallel tensor as the rank's TP shard (the owner-only sync). Checkpoints use the whole model's
names, so a pp=2 -> pp=1 resume needs no renaming (a tied embedding is held twice and written once).
MoE under PP: with `StageFeed.moe_loads` set, each stage adds its MoE layers' expert loads of the
real tokens (the padding's subtracted) per forward, and with `StageFeed.route_counts_M2` their
route-mismatch counts per micro-batch; the engine turns them into its load metrics, DeepSeek-V3's
bias update and moe/route_mismatch_frac. With `StageFeed.aux_loss_sum` set (train.moe_aux_loss_coef
> 0), each stage back-propagates its MoE layers' auxiliary loss (real tokens only) through its own
output, as Megatron-LM's MoEAuxLossAutoScaler does (`pp_aux.py`): the last stage's loss does not
hold it.

TP/EP/AC/compile go inside `parallelize_stage` (each stage module is a model of its own to them).
PP x TP (with sequence parallelism): between blocks the residual stream is sharded over tokens, so
each TP rank sends its own token shard, a plain [1, budget / tp, D] tensor, to the same TP rank of
the next stage (the pp group joins ranks of one TP coordinate), as torchtitan does. Gathering the
shards before each send instead would move tp times the bytes and add an all-gather plus a
re-slice per boundary for nothing: the next stage's first norm wants the shard again. So the
budget must be a multiple of tp (`check_budget`); the last stage gathers the final-normed shards
and runs the vocabulary-parallel head (`vocab_parallel.py`), every TP rank getting the same
[1, 2, budget] output and loss.
PP x EP: each stage's EP ranks (data-parallel ranks of that stage) run the same schedule, so their
all-to-alls pair up micro-batch by micro-batch; `clip_grad_norm_` sums the expert squares over EP.
PP x CP: every padded micro-batch is cut into cp equal shares (`cp.fixed_shares`: the documents
balanced by attention cost, the padding filling each share), so a stage sends [1, budget / cp, D];
the last stage gathers the selected logprobs over its cp ranks (`CPShard.gather_selected`), every
cp rank computing the same loss, its backward covering its own tokens.
These compose: with TP and CP together a stage sends [1, budget / (cp x tp), D] (each CP share
split over the TP ranks), and EP borrows its ranks from the stage's dp x cp x tp.
FSDP must not reshard after forward under PP (each micro-batch would gather the layers again).
Tied embeddings: the last stage holds the embedding as its head and `Pipeline.clip_grad_norm_`
sums the two gradients. Shared-prompt micro-batches and MoE routes (compared, or replayed) pass
through as in `CausalLM.hidden_states`.

Shape legend: N tokens of a micro-batch, P the token budget, K selected positions, M micro-batches,
D hidden size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)
from torch.distributed.tensor import DTensor

from rlloom.models.lora import LORA_PARAMS, adapted_weights
from rlloom.models.model import unwrapped_name
from rlloom.models.moe import GroupedExperts
from rlloom.parallel.grad_norm import grad_norm, scale_to_max_norm_
from rlloom.parallel.pp_batches import PipeMicroBatch, StageFeed, check_budget, pad_to_budget
from rlloom.parallel.pp_stages import (
    SCHEDULE_NAMES,
    PipelineStageModule,
    StageModel,
    check_pp,
    rank_stages,
    split_layers,
)
from rlloom.parallel.tp_shard import exported, tp_local_shape, tp_shard_of

SCHEDULES = dict(
    zip(SCHEDULE_NAMES, (Schedule1F1B, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble), strict=True)
)
PipeLossFn = Callable[[int, torch.Tensor, torch.Tensor | None], torch.Tensor]
"""(micro-batch index, logp_K, entropy_K or None) -> scalar loss already divided by the global normaliser."""


def _mb_to_int(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook run before FSDP's: the micro-batch index as a host int (FSDP would copy the
    [1] tensor to the GPU, and reading it back there costs a host sync)."""
    mb = kwargs["mb"]
    return args, {**kwargs, "mb": mb if isinstance(mb, int) else int(mb[0])}


class Pipeline:
    """Runs this rank's stages with one schedule; see the module docstring for the contract."""

    def __init__(
        self,
        modules: list[nn.Module],
        stage_ids: list[int],
        num_stages: int,
        pp_mesh: DeviceMesh,
        *,
        schedule: str,
        budget: int,
        hidden_size: int,
        device: torch.device,
        dtype: torch.dtype,
        tp: int = 1,
        ep_group: dist.ProcessGroup | None = None,
        cp_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.group = pp_mesh.get_group()
        self.cp_group = cp_group
        """Context parallelism: the ranks of this stage that split each micro-batch, else None."""
        cp = dist.get_world_size(cp_group) if cp_group is not None else 1
        self.ep_group = ep_group
        """Expert parallelism: the ranks of this stage that split the routed experts, else None."""
        self.pp = pp_mesh.size()
        self.schedule_name, self.budget, self.device, self.dtype = schedule, budget, device, dtype
        self.num_stages = num_stages
        self.modules = modules
        self.feed = StageFeed()
        self.stages = []
        # Between stages: this rank's share of the residual stream (budget / (cp x tp) tokens).
        local = budget // (cp * tp)
        hidden = torch.empty(1, local, hidden_size, dtype=dtype, device="meta", requires_grad=True)
        for module, s in zip(modules, stage_ids, strict=True):
            module.register_forward_pre_hook(_mb_to_int, prepend=True, with_kwargs=True)
            stage_module(module).feed = self.feed
            # Static shapes: no metadata exchange with real data, and the same shapes every step.
            first, last = s == 0, s == num_stages - 1
            inputs = torch.empty(1, budget // cp, dtype=torch.int64, device="meta") if first else hidden
            outputs = torch.empty(1, 2, budget, dtype=torch.float32, device="meta") if last else hidden
            self.stages.append(
                PipelineStage(
                    module, s, num_stages, device, input_args=inputs, output_args=outputs, group=self.group
                )
            )
        self.stage_ids = stage_ids
        self.has_first = 0 in stage_ids
        self.last_rank = dist.get_global_rank(self.group, (num_stages - 1) % self.pp)
        self._schedule: tuple[tuple[int, bool], object] | None = None
        self._loss_fn: PipeLossFn | None = None

    def _set_head(self, temperature: float, with_entropy: bool, replay_routes: bool) -> None:
        self.feed.temperature, self.feed.with_entropy = temperature, with_entropy
        self.feed.replay_routes = replay_routes

    def num_micro_batches(self, n: int) -> int:
        """Micro-batches the schedule runs for `n` real ones: a multiple of pp, at least pp (fillers added)."""
        return -(-max(n, 1) // self.pp) * self.pp

    def _get_schedule(self, n: int, train: bool):
        if self._schedule is None or self._schedule[0] != (n, train):
            cls = SCHEDULES[self.schedule_name]
            stages = self.stages[0] if cls is Schedule1F1B else self.stages
            loss = self._loss if train else None
            self._schedule = ((n, train), cls(stages, n, loss_fn=loss, scale_grads=False))
        return self._schedule[1]

    def _loss(self, out_12P: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        i = int(target[0])
        batch = self.feed.micro_batches[i]
        if not batch.real:
            return out_12P.sum() * 0.0  # zero-weight filler: the same backward as a real micro-batch
        k = batch.positions_K.numel()
        entropy_K = out_12P[0, 1, :k] if self.feed.with_entropy else None
        # sum(): a scalar that is not a view (zero-bubble schedules detach the loss in place)
        return self._loss_fn(i, out_12P[0, 0, :k], entropy_K).sum()

    def _run(self, mbs: list[PipeMicroBatch | None], train: bool, losses: list | None) -> torch.Tensor | None:
        n = self.num_micro_batches(len(mbs))
        padded = [pad_to_budget(mb, self.budget, self.device, self.cp_group) for mb in mbs]
        filler = pad_to_budget(None, self.budget, self.device, self.cp_group)
        self.feed.micro_batches = padded + [filler] * (n - len(mbs))
        schedule = self._get_schedule(n, train)
        index_M = torch.arange(n)
        args = (torch.cat([p.input_ids_1P for p in self.feed.micro_batches]),) if self.has_first else ()
        run = schedule.step if train else schedule.eval
        try:
            return run(*args, mb=index_M, target=index_M, losses=losses)
        finally:
            self.feed.micro_batches = []

    def forward_backward(
        self,
        mbs: list[PipeMicroBatch | None],
        loss_fn: PipeLossFn,
        *,
        temperature: float = 1.0,
        with_entropy: bool = False,
        replay_routes: bool = False,
    ) -> torch.Tensor:
        """Accumulate into the stages' gradients the backward of sum_i loss_fn(i, ...) over the
        micro-batches `mbs` (None = zero-weight filler); returns the losses [len(mbs)] on every pp rank."""
        self._set_head(temperature, with_entropy, replay_routes)
        self._loss_fn = loss_fn
        losses: list[torch.Tensor] = []
        self._run(mbs, True, losses)
        losses_M = torch.zeros(self.num_micro_batches(len(mbs)), dtype=torch.float32, device=self.device)
        if losses:
            losses_M = torch.stack([x.detach().float() for x in losses])
        dist.broadcast(losses_M, src=self.last_rank, group=self.group)
        return losses_M[: len(mbs)]

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Finish this step's gradients and clip them; returns the norm before clipping.

        With tied embeddings the first stage's embedding gradient and the last stage's head gradient
        are summed first (both copies then hold the whole gradient). The norm is the whole model's
        2-norm (over dp/tp shards and the pp ranks, the tied weight counted once); gradients are
        scaled to at most `max_norm` (0 = only measure). Call once per optimizer step, after the last
        `forward_backward`, in place of `rlloom.parallel.clip_grad_norm_`.
        """
        params = [p for m in self.modules for p in m.parameters() if p.grad is not None]
        tied = self._tied_weight()
        if tied is not None and tied.requires_grad:  # LoRA's frozen embedding has no gradient
            peer = dist.get_global_rank(self.group, self.pp - 1 if self.has_first else 0)
            mine = _local(tied.grad)
            theirs = torch.empty_like(mine)
            ops = [
                dist.P2POp(dist.isend, mine, peer, self.group),
                dist.P2POp(dist.irecv, theirs, peer, self.group),
            ]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            mine += theirs
        counted = [p for p in params if not (p is tied and not self.has_first)]
        experts = self._expert_params() if self.ep_group is not None else []
        sq = (
            grad_norm(counted, ep_params=experts, ep_group=self.ep_group).square()
            if counted
            else torch.zeros((), device=self.device)
        )
        dist.all_reduce(sq, group=self.group)
        norm = sq.sqrt()
        scale_to_max_norm_([_local(p.grad) for p in params], norm, max_norm)
        return norm

    def _expert_params(self) -> list[nn.Parameter]:
        """This rank's routed-expert parameters (split over the EP ranks outside any DTensor)."""
        return [
            p
            for module in self.modules
            for sub in module.modules()
            if isinstance(sub, GroupedExperts) and hasattr(sub, "ep_range")
            for p in sub.parameters()
        ]

    def _tied_weight(self) -> nn.Parameter | None:
        """This rank's copy of a tied embedding (first or last stage), None if untied or neither."""
        for module in self.modules:
            model = stage_module(module).model
            if model.tied and model.tok_embeddings is not None:
                return model.tok_embeddings.weight
        return None

    @torch.no_grad()
    def full_weights(self, *, tp_local_shards: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """(name in the whole CausalLM, full tensor) of every tensor of its state dict (parameters and
        persistent buffers such as DeepSeek-V3's expert bias), in the model's order, on every pp rank
        (weight sync, Hugging Face export): each stage's rank gathers its shards and broadcasts them
        over the pp group. A tied embedding comes once. Collective: every rank must consume the generator.
        `tp_local_shards`: a tensor-parallel tensor is gathered over FSDP only and comes as this rank's
        TP shard (`tp_shard.tp_local`; the pp group's ranks share their tp rank), the owner-only weight sync."""
        # LoRA: an adapted weight goes out merged (W + scale x B A, `lora.merged_weight`, made when
        # it is sent), the adapters never
        mine = {}
        for s, m in zip(self.stage_ids, self.modules):
            adapted = adapted_weights(m)
            mine[s] = [
                (model_name(n), p, adapted.get(n))
                for n, p in m.state_dict().items()
                if not n.endswith(LORA_PARAMS)
            ]

        def local(p: torch.Tensor) -> bool:
            return tp_local_shards and tp_shard_of(p) is not None

        shapes = [
            (s, [(n, tp_local_shape(p) if local(p) else tuple(p.shape), p.dtype) for n, p, _ in params])
            for s, params in mine.items()
        ]
        everyone: list[list] = [[] for _ in range(self.pp)]
        dist.all_gather_object(everyone, shapes, group=self.group)
        seen: set[str] = set()
        for s, owner, params in sorted(
            (s, r, params) for r, held in enumerate(everyone) for s, params in held
        ):
            for i, (name, shape, dtype) in enumerate(params):
                if name in seen:  # the last stage's copy of a tied embedding
                    continue
                seen.add(name)
                if s in mine:
                    _, param, lora = mine[s][i]
                    tensor = exported(lora.merged_weight() if lora else param, tp_local_shards).contiguous()
                else:
                    tensor = torch.empty(shape, dtype=dtype, device=self.device)
                dist.broadcast(tensor, src=dist.get_global_rank(self.group, owner), group=self.group)
                yield name, tensor

    @torch.no_grad()
    def forward_logprobs(
        self,
        mbs: list[PipeMicroBatch | None],
        *,
        temperature: float = 1.0,
        with_entropy: bool = False,
        replay_routes: bool = False,
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """(logp_K, entropy_K or None) fp32 of each micro-batch, on every pp rank (forward only)."""
        self._set_head(temperature, with_entropy, replay_routes)
        n = self.num_micro_batches(len(mbs))
        out = self._run(mbs, False, None)
        out_M2P = out if out is not None else torch.zeros(n, 2, self.budget, device=self.device)
        out_M2P = out_M2P.float().contiguous()
        for module in self.modules:  # FSDP roots stay gathered after a forward (see apply_fsdp)
            if isinstance(module, FSDPModule):
                module.reshard()
        dist.broadcast(out_M2P, src=self.last_rank, group=self.group)
        result = []
        for i, mb in enumerate(mbs):
            k = 0 if mb is None else mb.positions_K.numel()
            result.append((out_M2P[i, 0, :k], out_M2P[i, 1, :k] if with_entropy else None))
        return result


def model_name(name: str) -> str:
    """A stage module's parameter name as the whole CausalLM's (no wrapper prefixes)."""
    return unwrapped_name(name).removeprefix("model.")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def stage_module(module: nn.Module) -> PipelineStageModule:
    """The PipelineStageModule itself (FSDP2 keeps the class, wrappers that nest it expose `.module`)."""
    return module if isinstance(module, PipelineStageModule) else module.module


def apply_pp(
    model: nn.Module,
    pp_mesh: DeviceMesh,
    *,
    schedule: str,
    budget: int,
    device: torch.device,
    dtype: torch.dtype,
    virtual_stages: int = 1,
    first_stage_layers: int = 0,
    last_stage_layers: int = 0,
    chunk_tokens: int = 1024,
    parallelize_stage: Callable[[PipelineStageModule], nn.Module] | None = None,
    tp: int = 1,
    ep_group: dist.ProcessGroup | None = None,
    cp_group: dist.ProcessGroup | None = None,
    value_head: nn.Linear | None = None,
) -> tuple[list[nn.Module], Pipeline]:
    """Cut the native CausalLM `model` into this pp rank's stage modules, parallelise each with
    `parallelize_stage` (TP, AC, FSDP...; default: moved to `device`) and return them with the runner.

    `budget`: tokens of every micro-batch (train.max_tokens_per_micro_batch); `dtype`: the compute
    dtype of the activations sent between stages. The modules `model` held outside this rank's
    stages are no longer referenced by what is returned. `tp`: the tensor-parallel degree
    `parallelize_stage` applies (stages then exchange token shards of budget / tp tokens);
    `ep_group`: the EP ranks of this stage when `parallelize_stage` splits the experts (`ep.apply_ep`);
    `cp_group`: the CP ranks of this stage (each runs budget / cp tokens of every micro-batch).
    `value_head`: `model` is PPO's critic (its lm head dropped) and this its value head, which the
    last stage runs in place of the logprob head (its output holds values where logprobs would be).
    """
    check_pp(model.args, pp_mesh.size(), schedule, virtual_stages)
    check_budget(budget, tp * (dist.get_world_size(cp_group) if cp_group is not None else 1))
    num_stages = pp_mesh.size() * virtual_stages
    ranges = split_layers(
        model.args.num_layers,
        num_stages,
        first_stage_layers=first_stage_layers,
        last_stage_layers=last_stage_layers,
    )
    stage_ids = rank_stages(pp_mesh.get_local_rank(), pp_mesh.size(), virtual_stages)
    modules: list[nn.Module] = []
    for s in stage_ids:
        first, last = s == 0, s == num_stages - 1
        stage = PipelineStageModule(
            StageModel(model, ranges[s], is_first=first, is_last=last, value_model=value_head is not None),
            is_first=first,
            is_last=last,
            chunk_tokens=chunk_tokens,
            fused_head=device.type == "cuda",
            score=value_head,
        )
        modules.append(parallelize_stage(stage) if parallelize_stage is not None else stage.to(device))
    pipe = Pipeline(
        modules,
        stage_ids,
        num_stages,
        pp_mesh,
        schedule=schedule,
        budget=budget,
        hidden_size=model.args.hidden_size,
        device=device,
        dtype=dtype,
        tp=tp,
        ep_group=ep_group,
        cp_group=cp_group,
    )
    return modules, pipe
