"""Pipeline parallelism: the native model cut into stages, run by a torch.distributed.pipelining schedule.

- `split_layers` assigns contiguous decoder layers to the pp x virtual_stages stages; the first and
  last stage may be given a fixed size (`parallel.pp_first_stage_layers`/`pp_last_stage_layers`,
  as slime's decoder-last-pipeline-num-layers), the others share the rest, with the embedding and
  the head each weighing as much as one layer. Stage s runs on pp rank s % pp (looped placement).
- `PipelineStageModule` is one stage: the CausalLM's modules it holds (the first stage the
  embedding, the last the final norm and the logprob head), under the whole model's parameter names
  (`model.layers.7...`, as the engine's PolicyHead), so checkpoints and optimizers see one model.
- `Pipeline` runs a schedule ("1f1b", "interleaved", "zero_bubble") over micro-batches padded to
  ONE token budget: pipelining fixes activation shapes when it first runs, so every micro-batch is
  the packed stream plus a padding segment up to the budget. The last stage writes the K selected
  logprobs (and entropies) into a fixed [1, 2, budget] output; the caller's loss function gets
  them per micro-batch and returns that micro-batch's loss sum divided by the GLOBAL normaliser
  (no per-micro-batch or per-stage rescaling: the schedule runs with scale_grads=False).

How the training engine plugs it in (per rank, after `ParallelDims.build_mesh`):

    stages, pipe = apply_pp(model, dims.pp_mesh(), schedule=..., virtual_stages=..., first_stage_layers=...,
                            last_stage_layers=..., budget=cfg.max_tokens_per_micro_batch, device=..., dtype=...,
                            parallelize_stage=lambda m: apply_fsdp(m, dims.dp_shard_mesh(), ...,
                                                                   reshard_after_forward=False, layers_of=m.model))
    # optimizer over the parameters of `stages`; per step, micro-batches from plan_rank as PipeMicroBatch:
    losses_M = pipe.forward_backward(mbs, loss_fn)      # loss_fn(i, logp_K, entropy_K) -> loss_sum_i / normaliser
    logps = pipe.forward_logprobs(mbs, temperature=..., with_entropy=...)   # [(logp_K, entropy_K)] on every pp rank

TP/EP/AC/compile go inside `parallelize_stage` (each stage module is a model of its own to them);
FSDP must not reshard after forward under PP (each micro-batch would gather the layers again).
Not supported yet (refused): tied embeddings, shared-prompt packing and routing replay.

Shape legend: N tokens of a micro-batch, P the token budget, K selected positions, M micro-batches,
D hidden size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

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

from rlloom.models.args import ModelArgs
from rlloom.models.attention_ops import AttnLayout
from rlloom.models.logprobs import token_logprobs
from rlloom.parallel.grad_norm import grad_norm

SCHEDULES = {
    "1f1b": Schedule1F1B,
    "interleaved": ScheduleInterleaved1F1B,
    "zero_bubble": ScheduleInterleavedZeroBubble,
}
PipeLossFn = Callable[[int, torch.Tensor, torch.Tensor | None], torch.Tensor]
"""(micro-batch index, logp_K, entropy_K or None) -> scalar loss already divided by the global normaliser."""


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


@dataclass
class _Padded:
    """A micro-batch padded to the budget, on the device: one padding segment after the real tokens."""

    input_ids_1P: torch.Tensor
    position_ids_P: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    positions_K: torch.Tensor
    targets_K: torch.Tensor
    real: bool


def pad_to_budget(mb: PipeMicroBatch | None, budget: int, device: torch.device) -> _Padded:
    """`mb` padded with a segment of its own up to `budget` tokens; None gives an all-padding filler."""
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
    if pad:
        cu = torch.cat([cu, torch.tensor([budget], dtype=torch.int32)])
    return _Padded(
        ids.view(1, budget).to(device),
        pos.to(device),
        cu.to(device),
        max(mb.max_seqlen, pad),
        mb.positions_K.to(device),
        mb.targets_K.to(device),
        real=mb.input_ids_N.numel() > 0,
    )


@dataclass
class _Feed:
    """What the stages of one schedule step read: the padded micro-batches and the head's settings."""

    micro_batches: list[_Padded] = field(default_factory=list)
    temperature: float = 1.0
    with_entropy: bool = False


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
        self.feed = _Feed()

    def forward(self, x: torch.Tensor, mb: int) -> torch.Tensor:
        batch = self.feed.micro_batches[mb]
        h = self.model.tok_embeddings(x[0]) if self.is_first else x[0]
        cos, sin = self.model.rope(batch.position_ids_P, h.dtype)
        layout = AttnLayout(kind="packed", cu_seqlens=batch.cu_seqlens, max_seqlen=batch.max_seqlen)
        for layer in self.model.layers.values():
            h = layer(h, cos, sin, layout)
        if not self.is_last:
            # Not a view: zero-bubble schedules detach a stage's outputs in place after the input backward.
            return h.unsqueeze(0).clone()
        return self._head(self.model.norm(h), batch)

    def _head(self, hidden_PD: torch.Tensor, batch: _Padded) -> torch.Tensor:
        positions_K, targets_K = batch.positions_K, batch.targets_K
        num_selected = positions_K.numel()
        if num_selected == 0:  # one position, kept connected to every parameter with weight 0
            positions_K, targets_K = positions_K.new_zeros(1), targets_K.new_zeros(1)
        logp_K, entropy_K = token_logprobs(
            hidden_PD[positions_K],
            self.model.lm_head_weight,
            targets_K,
            temperature=self.feed.temperature,
            chunk_tokens=self.chunk_tokens,
            with_entropy=self.feed.with_entropy,
            fused=self.fused_head,
        )
        if entropy_K is None:
            entropy_K = torch.zeros_like(logp_K)
        out_12P = hidden_PD.new_zeros(1, 2, hidden_PD.shape[0], dtype=torch.float32)
        out_12P[0, :, : logp_K.numel()] = torch.stack([logp_K, entropy_K]) * (1.0 if num_selected else 0.0)
        return out_12P


def _mb_to_int(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook run before FSDP's: the micro-batch index as a host int (FSDP would copy the
    [1] tensor to the GPU, and reading it back there costs a host sync)."""
    return args, {**kwargs, "mb": int(kwargs["mb"][0])}


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
    ) -> None:
        self.group = pp_mesh.get_group()
        self.pp = pp_mesh.size()
        self.schedule_name, self.budget, self.device = schedule, budget, device
        self.num_stages = num_stages
        self.modules = modules
        self.feed = _Feed()
        self.stages = []
        hidden = torch.empty(1, budget, hidden_size, dtype=dtype, device="meta", requires_grad=True)
        for module, s in zip(modules, stage_ids, strict=True):
            module.register_forward_pre_hook(_mb_to_int, prepend=True, with_kwargs=True)
            _stage_module(module).feed = self.feed
            # Static shapes: no metadata exchange with real data, and the same shapes every step.
            first, last = s == 0, s == num_stages - 1
            inputs = torch.empty(1, budget, dtype=torch.int64, device="meta") if first else hidden
            outputs = torch.empty(1, 2, budget, dtype=torch.float32, device="meta") if last else hidden
            self.stages.append(
                PipelineStage(
                    module, s, num_stages, device, input_args=inputs, output_args=outputs, group=self.group
                )
            )
        self.has_first = 0 in stage_ids
        self.last_rank = dist.get_global_rank(self.group, (num_stages - 1) % self.pp)
        self._schedule: tuple[tuple[int, bool], object] | None = None
        self._loss_fn: PipeLossFn | None = None

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
        padded = [pad_to_budget(mb, self.budget, self.device) for mb in mbs]
        self.feed.micro_batches = padded + [pad_to_budget(None, self.budget, self.device)] * (n - len(mbs))
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
    ) -> torch.Tensor:
        """Accumulate into the stages' gradients the backward of sum_i loss_fn(i, ...) over the
        micro-batches `mbs` (None = zero-weight filler); returns the losses [len(mbs)] on every pp rank."""
        self.feed.temperature, self.feed.with_entropy = temperature, with_entropy
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
        if tied is not None:
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
        sq = grad_norm(counted).square() if counted else torch.zeros((), device=self.device)
        dist.all_reduce(sq, group=self.group)
        norm = sq.sqrt()
        if max_norm > 0 and params and bool(torch.isfinite(norm)):
            coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_([_local(p.grad) for p in params], coef)
        return norm

    def _tied_weight(self) -> nn.Parameter | None:
        """This rank's copy of a tied embedding (first or last stage), None if untied or neither."""
        for module in self.modules:
            model = _stage_module(module).model
            if model.tied and model.tok_embeddings is not None:
                return model.tok_embeddings.weight
        return None

    @torch.no_grad()
    def forward_logprobs(
        self, mbs: list[PipeMicroBatch | None], *, temperature: float = 1.0, with_entropy: bool = False
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """(logp_K, entropy_K or None) fp32 of each micro-batch, on every pp rank (forward only)."""
        self.feed.temperature, self.feed.with_entropy = temperature, with_entropy
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


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _stage_module(module: nn.Module) -> PipelineStageModule:
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
) -> tuple[list[nn.Module], Pipeline]:
    """Cut the native CausalLM `model` into this pp rank's stage modules, parallelise each with
    `parallelize_stage` (TP, AC, FSDP...; default: moved to `device`) and return them with the runner.

    `budget`: tokens of every micro-batch (train.max_tokens_per_micro_batch); `dtype`: the compute
    dtype of the activations sent between stages. The modules `model` held outside this rank's
    stages are no longer referenced by what is returned.
    """
    check_pp(model.args, pp_mesh.size(), schedule, virtual_stages)
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
            StageModel(model, ranges[s], is_first=first, is_last=last),
            is_first=first,
            is_last=last,
            chunk_tokens=chunk_tokens,
            fused_head=device.type == "cuda",
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
    )
    return modules, pipe


def check_pp(args: ModelArgs, pp: int, schedule: str, virtual_stages: int) -> None:
    """ValueError naming the first pipeline setting the model or the schedule cannot take."""
    if schedule not in SCHEDULES:
        raise ValueError(
            f"parallel.pp_schedule={schedule!r} is invalid: must be one of {', '.join(SCHEDULES)}. Fix: pick one."
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
