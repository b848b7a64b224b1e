"""NativeTrainEngine: the PyTorch training engine (bf16 compute, fp32 master weights) in any layout
of TP/SP, EP and FSDP2 that `rlloom.parallel.parallelize` builds; the engine itself only knows the
few facts of `EngineLayout` (layout.py).

One call of `train_step` is one optimizer step over a global batch:

    plan     balance samples over data-parallel ranks by tokens, pack each rank's share into
             micro-batches of at most max_tokens_per_micro_batch tokens (no padding, no truncation);
             with share_prompts the packing units are groups (one prompt copy + its responses).
             The TP ranks of one dp rank run the same micro-batches (padded to a multiple of tp);
             so do its CP ranks, each on its share of every stream (rlloom.parallel.cp)
    run      per micro-batch: packed forward, logprobs at response positions, the caller's loss_fn,
             backward of loss_sum / loss_normalizer (gradients accumulate; FSDP sums them over ranks)
    step     global grad norm, clip, AdamW (skipped when the loss or the norm is not finite, or when a
             trial of the update finds that a new parameter would not be finite: step_guard.py)

Under pipeline parallelism (parallel.pp > 1; pipeline.py) the same plan runs through the stages
of a `rlloom.parallel.pp.Pipeline`: every micro-batch is padded to the token budget, the loss of
each runs on the last stage's rank, whose metrics every pp rank returns, and the grad norm is taken
once per step over the pp ranks. MoE loads and route mismatches are counted by the stages (real
tokens only) and merged over the pp ranks; the MoE auxiliary loss is refused.

Every rank receives the same global batch and computes the same plan from it, so no plan is sent.
Ranks with fewer micro-batches run zero-weight copies of their smallest sample, so every rank issues
the same collectives. Because each micro-batch's loss sum is divided by the normaliser of the
global batch and gradients are summed, loss and gradients equal those of the whole batch at once,
for any token budget and any layout (the normaliser counts the tokens of every dp rank's samples;
TP ranks hold the same samples and are not counted again).

Shape legend: B samples of the global batch, b of a micro-batch, T response tokens (batch.T).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rlloom.algorithms._validate import deferred_finite_checks
from rlloom.config.components import ParallelConfig, TrainEngineConfig
from rlloom.data.types import RolloutBatch
from rlloom.devices import to_device
from rlloom.engines.train.base import LossFn
from rlloom.engines.train.native.checkpoint import EXPERTS, load_checkpoint, save_checkpoint
from rlloom.engines.train.native.flops import active_body_params, step_flops
from rlloom.engines.train.native.layout import EngineLayout
from rlloom.engines.train.native.lr_schedule import lr_at
from rlloom.engines.train.native.microbatch import plan_rank, shared_prompt_units
from rlloom.engines.train.native.moe_balance import MoEBalance, moe_layers_of
from rlloom.engines.train.native.optimizer import EngineOptimizer
from rlloom.engines.train.native.pipeline import (
    PipeBatch,
    from_last_stage,
    merge_moe_metrics,
    pipeline_weight_layouts,
    stage_view,
)
from rlloom.engines.train.native.policy import PolicyHead, run_micro_batch
from rlloom.engines.train.native.step_guard import (
    adamw_would_be_finite,
    all_finite,
    all_true,
    optimizer_state_tensors,
)
from rlloom.engines.train.native.weights import WeightLayout, named_weight_buckets, weight_layouts
from rlloom.models import from_pretrained
from rlloom.observability.memory import memory_metrics, reset_peak_memory
from rlloom.observability.metrics import Max, Mean, Metric, MetricsAccumulator, Min, Sum, reduce_across_ranks
from rlloom.observability.mfu import H100_BF16_PEAK_FLOPS
from rlloom.parallel import ParallelDims, clip_grad_norm_, init_distributed
from rlloom.parallel.cp import check_cp_layout
from rlloom.parallel.layers import decoder_layers, layer_items
from rlloom.parallel.parallelize import parallelize, parallelize_pp
from rlloom.parallel.pp import Pipeline


class NativeTrainEngine:
    """Training engine over a native CausalLM; see the module docstring for one step's anatomy.

    `model`: a native CausalLM (fp32 weights on CPU or `device`). `dtype`: compute dtype (default
    bf16 on CUDA, fp32 on CPU). With more than one rank (an initialised process group, or torchrun
    variables WORLD_SIZE/RANK/MASTER_ADDR/MASTER_PORT), a compute dtype other than fp32, or
    `parallel_dims`, the model is parallelised in that layout (`pipeline`: the pipeline settings of
    the `parallel` section, used when parallel_dims.pp > 1) (default: FSDP2 over every rank; a
    one-rank process group is started when none exists). `total_steps`: optimizer steps of the run,
    needed by the linear and cosine LR schedules. `frozen`: a forward-only reference (`build_reference`).
    """

    def __init__(
        self,
        cfg: TrainEngineConfig,
        model: nn.Module,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        total_steps: int | None = None,
        parallel_dims: ParallelDims | None = None,
        pipeline: ParallelConfig | None = None,
        reshard_after_forward: bool = True,
        frozen: bool = False,
    ) -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        self.compute_dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.total_steps = total_steps
        self.pipeline_settings = pipeline or ParallelConfig()
        """The `parallel` section's pipeline settings (pp_schedule, pp_virtual_stages, stage sizes)."""
        self.frozen = frozen
        """A forward-only reference: weights in the compute dtype, no gradients, no optimizer."""
        lr_at(0, cfg, total_steps)  # fail now, not at the first step, on a schedule without total_steps
        world_size = (
            dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
        )
        self.sharded = world_size > 1 or self.compute_dtype != torch.float32 or parallel_dims is not None

        # Trained parameters are the fp32 master weights; a frozen reference keeps the compute dtype.
        self.model = model.to(self.compute_dtype).requires_grad_(False) if frozen else model.float()
        self._body_params = active_body_params(self.model)  # before expert parallelism splits experts
        self.moe_balance = (
            None
            if frozen
            else MoEBalance.build(
                self.model, aux_loss_coef=cfg.moe_aux_loss_coef, bias_update_rate=cfg.moe_bias_update_rate
            )
        )
        self.module = PolicyHead(
            self.model, chunk_tokens=cfg.logprob_chunk_tokens, fused_head=self.device.type == "cuda"
        )
        self.reshard_after_forward = reshard_after_forward
        self.dims: ParallelDims | None = None
        if self.sharded:
            init_distributed(self.device.type)  # also picks this rank's GPU (LOCAL_RANK)
            self.dims = parallel_dims or ParallelDims(world_size=dist.get_world_size())
            self.dims.build_mesh(self.device.type)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.layout = EngineLayout.of(self.dims)
        check_cp_layout(self.layout.cp, cfg.share_prompts)
        self.pipe: Pipeline | None = None
        """The pipeline runner under pipeline parallelism (parallel.pp > 1), else None."""
        self._stage_modules: list[nn.Module] = []
        if self.dims is not None and self.dims.pp > 1:
            self._build_pipeline(frozen)
        else:
            parallelize(
                self.model,
                self.dims,
                param_dtype=self.compute_dtype,
                reduce_dtype=torch.float32,
                ac_mode="off" if frozen else cfg.activation_checkpointing,
                ac_every_k=cfg.ac_every_k,
                compile_layers=cfg.compile and self.device.type == "cuda",  # after AC, before FSDP
                reshard_after_forward=reshard_after_forward,
                root=self.module,
            )
        if not self.sharded:
            self.module.to(self.device)
        self.dp_group, self.dp_rank, self.dp_size = (
            self.layout.dp_group,
            self.layout.dp_rank,
            self.layout.dp_size,
        )
        named = list(self.module.named_parameters())
        self._expert_params = [p for name, p in named if EXPERTS in name] if self.layout.ep_group else []
        self._optimizer = None if frozen else EngineOptimizer(named, cfg)
        self.version = 0
        """Optimizer steps applied so far: the policy version of the current weights."""
        self.num_skipped_steps = 0

    def _build_pipeline(self, frozen: bool) -> None:
        """Cut the model into this rank's stages (`parallelize_pp`); `self.module` becomes a view of
        them under the PolicyHead's names and `self.model` its CausalLM-like part."""
        if self.moe_balance is not None and self.cfg.moe_aux_loss_coef > 0:
            raise ValueError(
                f"train.moe_aux_loss_coef={self.cfg.moe_aux_loss_coef}: the MoE auxiliary loss is not built for "
                f"pipeline parallelism (parallel.pp={self.dims.pp}; the bias update, train.moe_bias_update_rate, "
                "is). Fix: set train.moe_aux_loss_coef=0, or parallel.pp=1."
            )
        self._moe_model = self.moe_balance is not None
        """The whole model has MoE layers: every pp rank joins the load metrics' exchange."""
        self._num_moe_layers = len(moe_layers_of(self.model))
        """MoE layers of the whole model (each pp rank holds some)."""
        par = self.pipeline_settings
        modules, self.pipe = parallelize_pp(
            self.model,
            self.dims,
            schedule=par.pp_schedule,
            virtual_stages=par.pp_virtual_stages,
            first_stage_layers=par.pp_first_stage_layers,
            last_stage_layers=par.pp_last_stage_layers,
            budget=self.cfg.max_tokens_per_micro_batch,
            device=self.device,
            param_dtype=self.compute_dtype,
            ac_mode="off" if frozen else self.cfg.activation_checkpointing,
            ac_every_k=self.cfg.ac_every_k,
            compile_layers=self.cfg.compile and self.device.type == "cuda",
            chunk_tokens=self.cfg.logprob_chunk_tokens,
        )
        self._stage_modules = modules
        self.module = stage_view(modules, self.model)
        self.model = self.module.model  # the layers of other stages are freed with the whole model
        if self.moe_balance is not None:  # this rank's MoE layers (None when its stages have none)
            self.moe_balance = MoEBalance.build(
                self.model, aux_loss_coef=0.0, bias_update_rate=self.cfg.moe_bias_update_rate
            )

    def _set_mode(self, train: bool) -> None:
        for module in self._stage_modules or [self.module]:
            module.train(train)

    @property
    def optimizer(self) -> EngineOptimizer:
        if self._optimizer is None:
            raise ValueError(
                "this engine is a frozen reference (build_reference): it has no optimizer and cannot train "
                "or be saved. Fix: train and save the policy engine (build_train_engine)."
            )
        return self._optimizer

    @classmethod
    def build(cls, cfg: TrainEngineConfig, model_path: str, **kwargs: Any) -> NativeTrainEngine:
        """Load a Hugging Face checkpoint folder (or the embedded model name) in fp32 on CPU and build."""
        return cls(cfg, from_pretrained(model_path, dtype=torch.float32, device="cpu"), **kwargs)

    # ---- planning and one micro-batch -------------------------------------------------------

    def _plan(self, batch: RolloutBatch) -> tuple[list[list[int] | None], int]:
        """This rank's micro-batches (None = a zero-weight filler) and the filler's sample index."""
        self._check_same_batch(batch)
        budget = self.cfg.max_tokens_per_micro_batch
        if not self.cfg.share_prompts:
            num_tokens = [s.num_tokens for s in batch.samples]
            return plan_rank(num_tokens, rank=self.dp_rank, num_ranks=self.dp_size, max_tokens=budget)
        units, unit_tokens = shared_prompt_units(
            batch.shared_prompt_groups(),
            [len(s.prompt_ids) for s in batch.samples],
            [len(s.response_ids) for s in batch.samples],
            budget,
        )
        return plan_rank(
            unit_tokens, rank=self.dp_rank, num_ranks=self.dp_size, max_tokens=budget, units=units
        )

    def _check_same_batch(self, batch: RolloutBatch) -> None:
        # A rank with another batch would plan other collectives and hang; one tiny all-reduce instead.
        if self.layout.world_size == 1:
            return
        local = torch.tensor(
            [len(batch), batch.num_tokens, batch.T], dtype=torch.float64, device=self._comm_device
        )
        both = torch.cat([local, -local])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.layout.world_group)
        if not torch.equal(both[:3], -both[3:]):
            raise ValueError(
                f"ranks received different batches (samples, tokens, T): rank {dist.get_rank()} has "
                f"{local.long().tolist()}, the max over ranks is {both[:3].long().tolist()}. Fix: pass every rank "
                "the same global batch; the engine picks each rank's share itself."
            )

    @property
    def _comm_device(self) -> torch.device:
        return self.device if dist.get_backend(self.layout.world_group) == "nccl" else torch.device("cpu")

    def _run(
        self,
        batch: RolloutBatch,
        indices: list[int],
        temperature: float,
        with_entropy: bool,
        routing_replay: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, int, int]:
        return run_micro_batch(
            self.module,
            batch.select(indices),
            self.device,
            temperature,
            with_entropy,
            share_prompts=self.cfg.share_prompts,
            replay_routes=routing_replay,
            pad_multiple=self.layout.tp,
            cp_group=self.layout.cp_group if self.layout.cp > 1 else None,
        )

    # ---- the engine interface ---------------------------------------------------------------

    @torch.no_grad()
    def forward_logprobs(
        self,
        batch: RolloutBatch,
        *,
        temperature: float = 1.0,
        with_entropy: bool = False,
        routing_replay: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logprobs (and entropies) of the batch's response tokens: fp32 [B, T] on CPU, 0 where masked.

        Every data-parallel rank passes the same global batch and gets the whole result. With
        `routing_replay` an MoE model routes each token to the experts the rollout recorded.
        """
        self._set_mode(False)
        micro_batches, filler = self._plan(batch)
        logp_BT = torch.zeros(len(batch), batch.T, dtype=torch.float32, device=self.device)
        entropy_BT = torch.zeros_like(logp_BT) if with_entropy else None
        if self.pipe is not None:
            self._pipe_logprobs(batch, micro_batches, logp_BT, entropy_BT, temperature, routing_replay)
            micro_batches = []
        for mb in micro_batches:
            logp_bT, entropy_bT, _, _ = self._run(
                batch, mb or [filler], temperature, with_entropy, routing_replay
            )
            if mb is None:
                continue
            rows = to_device(torch.tensor(mb), self.device)
            logp_BT[rows] = logp_bT
            if entropy_BT is not None:
                entropy_BT[rows] = entropy_bT
        if self.sharded and self.pipe is None:
            self.module.reshard()  # the root unit stays gathered after a forward (see apply_fsdp)
        if self.dp_size > 1:  # each row was computed on exactly one rank and is 0 elsewhere
            for t in (logp_BT, entropy_BT):
                if t is not None:
                    dist.all_reduce(t, group=self.dp_group)
        return logp_BT.cpu(), (entropy_BT.cpu() if entropy_BT is not None else None)

    def forward_backward(
        self,
        batch: RolloutBatch,
        loss_fn: LossFn,
        *,
        loss_normalizer: float,
        temperature: float = 1.0,
        with_entropy: bool = False,
        routing_replay: bool = False,
    ) -> dict[str, float]:
        """Replace the gradients with those of sum(loss_sum over micro-batches) / loss_normalizer.

        `loss_normalizer` is the global batch's, e.g. `rlloom.algorithms.losses.loss_normalizer(
        batch.response_mask(), mode)`. Returns metrics reduced over micro-batches and ranks.
        """
        if not (loss_normalizer > 0 and math.isfinite(loss_normalizer)):
            raise ValueError(
                f"loss_normalizer={loss_normalizer} is invalid: must be a finite number > 0. Fix: pass "
                "rlloom.algorithms.losses.loss_normalizer(global_mask_BT, agg_mode)."
            )
        self.optimizer.zero_grad()
        self._set_mode(True)
        micro_batches, filler = self._plan(batch)
        if self.pipe is not None:
            return self._pipe_forward_backward(
                batch, micro_batches, loss_fn, loss_normalizer, temperature, with_entropy, routing_replay
            )
        # No host reads inside the loop (metrics stay tensors, finiteness checks are queued): on CUDA
        # the host packs the next micro-batch while the GPU still runs this one.
        records: list[dict[str, Metric]] = []
        keep_gathered = self.sharded and self.cfg.gather_once_per_step
        balance = self.moe_balance
        total_tokens = self._computed_tokens(batch) if balance is not None else 1
        computed_here = 0  # tokens this rank's forward passes ran on (its share of each stream under CP)
        with deferred_finite_checks(), self._gathered_until_last(keep_gathered) as set_last:
            for i, mb in enumerate(micro_batches):
                set_last(i == len(micro_batches) - 1)
                logp_bT, entropy_bT, num_tokens, num_response = self._run(
                    batch, mb or [filler], temperature, with_entropy, routing_replay
                )
                if mb is None:
                    # Zero-weight filler: same collectives as a real micro-batch, no contribution.
                    (logp_bT.sum() * 0.0).backward()
                    continue
                loss_sum, mb_metrics = loss_fn(logp_bT, entropy_bT, torch.tensor(mb, dtype=torch.int64))
                _check_loss_sum(loss_sum)
                loss = loss_sum.reshape(()) / loss_normalizer
                if balance is not None:
                    # Under CP each rank's aux loss is its share's (the routing of its tokens).
                    aux, aux_metrics = balance.aux_term(num_tokens / total_tokens)
                    loss = loss if aux is None else loss + aux
                    records.append(aux_metrics)
                    balance.accumulate(self._padding_routed_here(num_tokens))
                loss.backward()
                computed_here += num_tokens
                records.append(_weighted(mb_metrics, num_response))
                records.append(self._route_metrics(batch, mb))
                records.append(
                    {
                        "train/loss": Sum(loss_sum.detach() / loss_normalizer),
                        "train/tokens": Sum(sum(batch.samples[i].num_tokens for i in mb)),
                        "train/response_tokens": Sum(num_response),
                    }
                )
        acc = MetricsAccumulator()
        acc.add_all(records)
        acc.add({"train/num_micro_batches": Max(len(micro_batches))})
        acc.add({"train/computed_tokens": Sum(self._summed_over_cp(computed_here))})
        return reduce_across_ranks(acc, self.dp_group)

    def _pipe_forward_backward(
        self,
        batch: RolloutBatch,
        micro_batches: list[list[int] | None],
        loss_fn: LossFn,
        loss_normalizer: float,
        temperature: float,
        with_entropy: bool,
        routing_replay: bool,
    ) -> dict[str, float]:
        """forward_backward through the pipeline: `loss_fn` runs on the last stage's rank, whose
        metrics (reduced over its dp ranks) every pp rank returns."""
        pb = PipeBatch.of(
            batch, micro_batches, share_prompts=self.cfg.share_prompts, replay_routes=routing_replay
        )
        records: list[dict[str, Metric]] = []

        def pipe_loss(i: int, logp_K: torch.Tensor, entropy_K: torch.Tensor | None) -> torch.Tensor:
            rows = pb.rows[i]
            entropy_bT = pb.spread(i, entropy_K) if entropy_K is not None else None
            loss_sum, mb_metrics = loss_fn(
                pb.spread(i, logp_K), entropy_bT, torch.tensor(rows, dtype=torch.int64)
            )
            _check_loss_sum(loss_sum)
            num_response = int(pb.masks[i].sum())
            records.append(_weighted(mb_metrics, num_response))
            records.append(
                {
                    "train/loss": Sum(loss_sum.detach() / loss_normalizer),
                    "train/tokens": Sum(sum(batch.samples[r].num_tokens for r in rows)),
                    "train/computed_tokens": Sum(pb.num_tokens[i]),
                    "train/response_tokens": Sum(num_response),
                }
            )
            return loss_sum.reshape(()) / loss_normalizer

        balance = self.moe_balance
        self.pipe.feed.moe_loads = {} if balance is not None else None
        with_routes = self._num_moe_layers > 0 and batch.samples[0].routed_experts is not None
        if with_routes:
            m = self.pipe.num_micro_batches(len(micro_batches))
            self.pipe.feed.route_counts_M2 = torch.zeros(m, 2, device=self.device)
        try:
            with deferred_finite_checks():
                self.pipe.forward_backward(
                    pb.micro_batches,
                    pipe_loss,
                    temperature=temperature,
                    with_entropy=with_entropy,
                    replay_routes=routing_replay,
                )
            if balance is not None:  # the real tokens this rank's stages routed (padding not counted)
                balance.add_loads(torch.stack([self.pipe.feed.moe_loads[str(i)] for i in balance.layers]))
            if with_routes:
                records += self._pipe_route_metrics(batch, pb, self.pipe.feed.route_counts_M2)
        finally:
            self.pipe.feed.moe_loads = self.pipe.feed.route_counts_M2 = None
        acc = MetricsAccumulator()
        acc.add_all(records)
        acc.add({"train/num_micro_batches": Max(len(micro_batches))})
        # Real tokens per token slot the pipeline computed (every micro-batch is padded to the budget).
        slots = self.pipe.num_micro_batches(len(micro_batches)) * self.pipe.budget
        acc.add({"perf/pp_budget_fill": Mean(sum(pb.num_tokens) / slots, weight=slots)})
        metrics = reduce_across_ranks(acc, self.dp_group)
        return from_last_stage(self.pipe, metrics)

    def _pipe_route_metrics(
        self, batch: RolloutBatch, pb: PipeBatch, counts_M2: torch.Tensor
    ) -> list[dict[str, Metric]]:
        """`moe/route_mismatch_frac` per micro-batch as `_route_metrics` gives it, from the counts each
        pp rank's stages recorded (summed over the pp ranks, and the TP/CP ranks that split tokens)."""
        counts_M2 = counts_M2.to(self._comm_device)
        groups = [self.pipe.group]
        groups += [self.layout.tp_group] if self.layout.tokens_split_over_tp else []
        groups += [self.layout.cp_group] if self.layout.cp > 1 else []
        for group in groups:
            dist.all_reduce(counts_M2, group=group)
        out = []
        for rows, (differ, compared) in zip(pb.rows, counts_M2.tolist()):
            if rows is None:
                continue
            weight = sum(len(batch.samples[i].routed_experts) for i in rows) * self._num_moe_layers
            out.append({"moe/route_mismatch_frac": Mean(differ / max(compared, 1.0), weight=weight)})
        return out

    def _pipe_logprobs(
        self,
        batch: RolloutBatch,
        micro_batches: list[list[int] | None],
        logp_BT: torch.Tensor,
        entropy_BT: torch.Tensor | None,
        temperature: float,
        routing_replay: bool,
    ) -> None:
        """forward_logprobs through the pipeline: this dp rank's rows of logp_BT (entropy_BT) filled."""
        pb = PipeBatch.of(
            batch, micro_batches, share_prompts=self.cfg.share_prompts, replay_routes=routing_replay
        )
        out = self.pipe.forward_logprobs(
            pb.micro_batches,
            temperature=temperature,
            with_entropy=entropy_BT is not None,
            replay_routes=routing_replay,
        )
        for i, (logp_K, entropy_K) in enumerate(out):
            if pb.rows[i] is None:
                continue
            rows = torch.tensor(pb.rows[i], device=self.device)
            logp_BT[rows] = pb.spread(i, logp_K).to(self.device)
            if entropy_BT is not None:
                entropy_BT[rows] = pb.spread(i, entropy_K).to(self.device)

    def _summed_over_cp(self, count: int) -> int:
        """A count of what this rank computed, summed over its cp ranks (the whole micro-batches')."""
        if self.layout.cp == 1:
            return count
        total = torch.tensor([count], dtype=torch.float64, device=self._comm_device)
        dist.all_reduce(total, group=self.layout.cp_group)
        return int(total.item())

    def _padding_routed_here(self, num_tokens: int) -> int:
        """How many of the padding tokens (tp - 1 at most, at the end of the stream; under CP of this
        rank's share, `num_tokens` being what `run_micro_batch` says this rank computed) this rank's
        MoE layers routed, the last ones they saw: all under TP alone (every TP rank routes the whole
        stream); the overlap with its own token shard when each TP rank routes its shard."""
        pad = -num_tokens % self.layout.tp
        if not (self.layout.tokens_split_over_tp and self.dims is not None):
            return pad
        shard = (num_tokens + pad) // self.layout.tp
        start = self.dims.tp_mesh().get_local_rank() * shard
        return max(0, min(start + shard, num_tokens + pad) - max(start, num_tokens))

    def _route_metrics(self, batch: RolloutBatch, rows: list[int]) -> dict[str, Metric]:
        """`moe/route_mismatch_frac`: the fraction of (token, MoE layer) pairs of this micro-batch whose
        experts, as the training router chooses them, differ from the ones the rollout used."""
        if batch.samples[rows[0]].routed_experts is None or not hasattr(self.model, "route_mismatch"):
            return {}
        counts = self.model.route_mismatch()
        if counts is None:
            return {}
        if self.layout.tokens_split_over_tp:  # each TP rank compared its own token shard
            counts = counts.to(self._comm_device)
            dist.all_reduce(counts, group=self.layout.tp_group)
        if self.layout.cp > 1:  # each CP rank compared its own share of the stream
            counts = counts.to(self._comm_device)
            dist.all_reduce(counts, group=self.layout.cp_group)
        compared = sum((len(batch.samples[i].routed_experts)) for i in rows) * len(self.model.moe_layers())
        return {"moe/route_mismatch_frac": Mean(counts[0] / counts[1].clamp(min=1), weight=compared)}

    def _computed_tokens(self, batch: RolloutBatch) -> int:
        """Tokens the forward passes over the whole global batch (prompts once per group when shared)."""
        if not self.cfg.share_prompts:
            return batch.num_tokens
        _, unit_tokens = shared_prompt_units(
            batch.shared_prompt_groups(),
            [len(s.prompt_ids) for s in batch.samples],
            [len(s.response_ids) for s in batch.samples],
            self.cfg.max_tokens_per_micro_batch,
        )
        return sum(unit_tokens)

    @contextlib.contextmanager
    def _gathered_until_last(self, enabled: bool) -> Iterator[Callable[[bool], None]]:
        """`gather_once_per_step`: yields `set_last(is_last)`, to call before each micro-batch. Until
        the last one the layers stay gathered after forward and backward and their gradients
        accumulate unsharded (no reduce-scatter); the last reduces them and reshards as usual. The
        FSDP settings are restored on exit, also after an error."""

        def keep(on: bool) -> None:
            self.module.set_requires_gradient_sync(not on)
            self.module.set_reshard_after_backward(not on)
            for _, layer in layer_items(decoder_layers(self.model)):
                layer.set_reshard_after_forward(not on and self.reshard_after_forward)

        if not enabled:
            yield lambda is_last: None
            return
        try:
            yield lambda is_last: keep(not is_last)
        finally:
            keep(False)

    def train_step(
        self,
        batch: RolloutBatch,
        loss_fn: LossFn,
        *,
        loss_normalizer: float,
        temperature: float = 1.0,
        with_entropy: bool = False,
        routing_replay: bool = False,
    ) -> dict[str, float]:
        """One optimizer step on the global batch; returns the step's metrics (same on every rank)."""
        reset_peak_memory(self.device)
        start = time.perf_counter()
        metrics = self.forward_backward(
            batch,
            loss_fn,
            loss_normalizer=loss_normalizer,
            temperature=temperature,
            with_entropy=with_entropy,
            routing_replay=routing_replay,
        )
        lr = lr_at(self.version, self.cfg, self.total_steps)
        if self.pipe is not None:  # once per step over the pp ranks (a tied embedding's two halves summed)
            grad_norm = float(self.pipe.clip_grad_norm_(self.cfg.grad_clip))
        else:
            grad_norm = float(
                clip_grad_norm_(
                    self.optimizer.params,
                    self.cfg.grad_clip,
                    ep_params=self._expert_params,
                    ep_group=self.layout.ep_group,
                )
            )
        skip = not (math.isfinite(grad_norm) and math.isfinite(metrics.get("train/loss", 0.0)))
        if not skip:
            skip = not self._step_if_finite(lr)
        if skip:  # never applied: no update, no version bump, and so never saved
            self.num_skipped_steps += 1
        else:
            self.version += 1
        self.optimizer.zero_grad()
        if self.moe_balance is not None:
            metrics |= self.moe_balance.finish(
                applied=not skip,
                group=self.layout.moe_count_group,
                comm_device=self._comm_device if self.layout.world_size > 1 else self.device,
            )
        if self.pipe is not None and self._moe_model:  # each pp rank holds some MoE layers
            metrics = merge_moe_metrics(self.pipe, metrics, self.moe_balance)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        metrics |= {"train/grad_norm": grad_norm, "train/lr": lr, "train/skipped_step": float(skip)}
        metrics |= self._perf_metrics(batch, metrics["train/response_tokens"], seconds)
        return metrics

    def _step_if_finite(self, lr: float) -> bool:
        """Apply the optimizer step only if every new parameter would be finite on every rank
        (step_guard.py: a trial of the same update, slice by slice); otherwise change nothing and
        return False."""
        self.optimizer.set_lr(lr)
        self.optimizer.stage_grads()
        flags = [adamw_would_be_finite(optim) for optim in self.optimizer.optimizers]
        if not all_true(flags, self.layout.world_group, self.device):
            return False
        self.optimizer.step()
        return True

    def _perf_metrics(self, batch: RolloutBatch, num_response: float, seconds: float) -> dict[str, float]:
        seq_lens = [s.num_tokens for s in batch.samples]
        out = {"perf/train_tok_per_s": sum(seq_lens) / seconds, "time/train_step_s": seconds}
        acc = MetricsAccumulator()
        memory = memory_metrics(self.device)
        acc.add(memory)
        if self.pipe is not None:  # pp ranks hold different layers: the lightest rank shows the imbalance
            acc.add({f"{k}_min_rank": Min(v.value) for k, v in memory.items()})
        out |= reduce_across_ranks(acc, self.layout.world_group)
        if self.device.type == "cuda":
            # The global batch's FLOPs over every device of the layout (pp x dp x tp x ...), not just
            # dp; under PP the padding to the token budget is not counted (it is no useful work).
            flops = step_flops(self.model, seq_lens, int(num_response), body_params=self._body_params)
            out["perf/mfu"] = flops / (seconds * H100_BF16_PEAK_FLOPS * self.layout.world_size)
        return out

    def named_weights(
        self, *, bucket_bytes: int = 1 << 29, dtype: torch.dtype | None = None, owned_only: bool = False
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Buckets of (Hugging Face name, full tensor) for weight sync; version is `self.version`.

        Gathers shards: every rank must consume the generator. `owned_only`: routed experts are not
        all-gathered over the EP ranks, this rank yields only its own (`weights.named_weight_buckets`).
        See `weights.tensor_checksum`.
        """
        return named_weight_buckets(
            self.model,
            bucket_bytes=bucket_bytes,
            dtype=dtype,
            ep_group=self.layout.ep_group,
            tensors=self.pipe.full_weights() if self.pipe is not None else None,
            owned_only=owned_only,
        )

    def weight_layouts(self) -> dict[str, WeightLayout]:
        """For each Hugging Face name `named_weights` yields, where it lives on this rank (native
        parameter, full shape, expert index and EP owner, DTensor mesh dimensions and placements);
        no data moves. This rank's EP rank is `layout.ep_rank`. Under pipeline parallelism
        `named_weights` gives every rank every stage's tensors, so this describes them all: each
        stage's as its own ranks hold it (an expert's EP rank is the same on every pp rank), in the
        order `named_weights` yields them (collective over the pp group)."""
        if self.pipe is None:
            return weight_layouts(self.model, ep=self.layout.ep)
        return pipeline_weight_layouts(self.pipe, ep=self.layout.ep)

    # ---- checkpoint and memory --------------------------------------------------------------

    def _dcp_optimizers(self) -> list[torch.optim.Optimizer]:
        optim = self.optimizer.device_optim
        return [optim] if optim is not None else []

    def save(self, path: str) -> None:
        """Save model, optimizer, schedule position and RNG states to the folder `path` (all ranks)."""
        self._check_finite_for_save(path)
        state = {"version": self.version, "num_skipped_steps": self.num_skipped_steps}
        save_checkpoint(
            path,
            self.module,
            self._dcp_optimizers(),
            self.optimizer.offloaded_state_dict(),
            state,
            experts=(self.layout.ep_rank, self.layout.ep),
        )

    def _check_finite_for_save(self, path: str) -> None:
        """Refuse (on every rank alike) to write parameters or optimizer state holding inf or NaN."""
        named = list(self.module.named_parameters()) + list(
            optimizer_state_tensors(self.optimizer.optimizers)
        )
        if all_finite([t for _, t in named], self.layout.world_group, self.device):
            return
        local = [name for name, t in named if not all_finite([t], None, self.device)]
        raise ValueError(
            f"refusing to save a checkpoint to {path!r}: tensors are not finite (on rank {self.dp_rank}: "
            f"{', '.join(local[:3]) or 'none; another rank'}{' ...' if len(local) > 3 else ''}), so it would "
            "not be resumable. Fix: resume from an earlier checkpoint and lower train.lr."
        )

    def load(self, path: str) -> None:
        """Restore a `save`d folder into this engine (built with the same model and settings)."""
        state, extra = load_checkpoint(
            path,
            self.module,
            self._dcp_optimizers(),
            self.optimizer.offloaded_state_dict(),
            experts=(self.layout.ep_rank, self.layout.ep),
        )
        self.optimizer.load_offloaded_state_dict(extra)
        self.version = int(state["version"])
        self.num_skipped_steps = int(state["num_skipped_steps"])

    def offload(self) -> None:
        """Move parameters, gradients and optimizer state to CPU (frees the GPU for rollout)."""
        self._move(torch.device("cpu"))
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def onload(self) -> None:
        """Move everything `offload` moved back to the engine's device."""
        self._move(self.device)

    def _move(self, device: torch.device) -> None:
        for module in self._stage_modules or [self.module]:
            module.to(device)  # FSDP2 keeps its sharded parameters registered across .to()
        if self._optimizer is not None:
            self._optimizer.move_state(device)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _weighted(metrics: Mapping[str, Any], weight: int) -> dict[str, Metric]:
    """loss_fn metrics as Metric values: plain scalars become token-weighted means."""
    return {
        k: v if isinstance(v, Mean | Sum | Max | Min) else Mean(v, weight=weight) for k, v in metrics.items()
    }


def _check_loss_sum(loss_sum: Any) -> None:
    if not isinstance(loss_sum, torch.Tensor) or loss_sum.numel() != 1:
        raise ValueError(
            f"loss_fn returned a loss of type {type(loss_sum).__name__} "
            f"{tuple(getattr(loss_sum, 'shape', ()))}; it must return a scalar tensor (the "
            "micro-batch's loss sum). Fix: return aggregate_loss_sum(loss_bT, mask_bT, mode)."
        )
