"""`MicroBatchRunner`: one rank's micro-batches through the policy without pipeline parallelism
(the FSDP2 / TP / CP / EP layouts of `rlloom.parallel.parallelize`); pipeline.py's `PipelineRunner`
does the same through the stages. The engine plans (plan.py) and calls one of the two.

Per micro-batch: packed forward (`policy.run_micro_batch`), logprobs at response positions, the
caller's loss_fn, backward of loss_sum / loss_normalizer (gradients accumulate; FSDP sums them
over ranks). A `None` micro-batch is a zero-weight copy of the filler sample, so every rank issues
the same collectives. No host reads inside the loop (metrics stay tensors, finiteness checks are
queued): on CUDA the host packs the next micro-batch while the GPU still runs this one.

Shape legend: B samples of the global batch, b of a micro-batch, T response tokens (batch.T).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rlloom.algorithms._validate import deferred_finite_checks
from rlloom.config import ParallelConfig, TrainEngineConfig
from rlloom.data.types import RolloutBatch
from rlloom.devices import to_device
from rlloom.engines.train.base import ForwardOptions, LossFn
from rlloom.engines.train.native.layout import EngineLayout
from rlloom.engines.train.native.moe_balance import MoEBalance
from rlloom.engines.train.native.plan import computed_tokens
from rlloom.engines.train.native.policy import PolicyHead, run_micro_batch
from rlloom.observability.metrics import Max, Mean, Metric, MetricsAccumulator, Min, Sum, reduce_across_ranks
from rlloom.parallel import ParallelDims
from rlloom.parallel.layers import decoder_layers, layer_items
from rlloom.parallel.mixed_precision import ComputeCopies
from rlloom.parallel.parallelize import parallelize


@dataclass(frozen=True, slots=True)
class MicroBatchRunner:
    """Runs the micro-batches of `module` (the PolicyHead over `model`, parallelised in `layout`)."""

    module: nn.Module
    model: nn.Module
    device: torch.device
    layout: EngineLayout
    cfg: TrainEngineConfig
    sharded: bool
    """The model is FSDP-wrapped (its root unit stays gathered after a forward)."""
    reshard_after_forward: bool
    moe_balance: MoEBalance | None
    copies: ComputeCopies | None
    """One device in a compute dtype below the fp32 masters: the stand-ins forward and backward run on."""

    @classmethod
    def build(
        cls,
        module: PolicyHead,
        dims: ParallelDims | None,
        cfg: TrainEngineConfig,
        *,
        pipeline: ParallelConfig,
        layout: EngineLayout,
        device: torch.device,
        param_dtype: torch.dtype,
        frozen: bool,
        sharded: bool,
        reshard_after_forward: bool,
    ) -> MicroBatchRunner:
        """Parallelise `module` (the PolicyHead over the model) in place in the layout of `dims`
        (`pipeline`: unused, the settings of `PipelineRunner.build`, which takes the same arguments)."""
        moe_balance = None
        if not frozen:  # before expert parallelism splits the experts
            moe_balance = MoEBalance.build(
                module.model, aux_loss_coef=cfg.moe_aux_loss_coef, bias_update_rate=cfg.moe_bias_update_rate
            )
        parallelize(
            module.model,
            dims,
            param_dtype=param_dtype,
            reduce_dtype=torch.float32,
            ac_mode="off" if frozen else cfg.activation_checkpointing,
            ac_every_k=cfg.ac_every_k,
            compile_layers=cfg.compile and device.type == "cuda",  # after AC, before FSDP
            reshard_after_forward=reshard_after_forward,
            root=module,
        )
        copies = None
        if not sharded:
            module.to(device)
            copies = ComputeCopies(module, param_dtype)
        return cls(
            module, module.model, device, layout, cfg, sharded, reshard_after_forward, moe_balance, copies
        )

    @property
    def modules(self) -> list[nn.Module]:
        """The modules holding this rank's parameters."""
        return [self.module]

    def run(
        self,
        batch: RolloutBatch,
        indices: list[int],
        options: ForwardOptions,
    ) -> tuple[torch.Tensor, torch.Tensor | None, int, int]:
        return run_micro_batch(
            self.module,
            batch.select(indices),
            self.device,
            options,
            share_prompts=self.cfg.share_prompts,
            pad_multiple=self.layout.tp,
            cp_group=self.layout.cp_group if self.layout.cp > 1 else None,
        )

    def logprobs(
        self,
        batch: RolloutBatch,
        micro_batches: list[list[int] | None],
        filler: int,
        options: ForwardOptions,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logp_BT (entropy_BT) on the device: this dp rank's rows filled, 0 elsewhere."""
        logp_BT = torch.zeros(len(batch), batch.T, dtype=torch.float32, device=self.device)
        entropy_BT = torch.zeros_like(logp_BT) if options.with_entropy else None
        with self.computing():
            for mb in micro_batches:
                logp_bT, entropy_bT, _, _ = self.run(batch, mb or [filler], options)
                if mb is None:
                    continue
                rows = to_device(torch.tensor(mb), self.device)
                logp_BT[rows] = logp_bT
                if entropy_BT is not None:
                    entropy_BT[rows] = entropy_bT
        if self.sharded:
            self.module.reshard()  # the root unit stays gathered after a forward (see apply_fsdp)
        return logp_BT, entropy_BT

    def forward_backward(
        self,
        batch: RolloutBatch,
        micro_batches: list[list[int] | None],
        filler: int,
        loss_fn: LossFn,
        *,
        loss_normalizer: float,
        options: ForwardOptions,
    ) -> dict[str, float]:
        """Accumulate the gradients of sum(loss_sum) / loss_normalizer; the metrics reduced over
        micro-batches and dp ranks."""
        records: list[dict[str, Metric]] = []
        keep_gathered = self.sharded and self.cfg.gather_once_per_step
        balance = self.moe_balance
        total_tokens = computed_tokens(batch, self.cfg) if balance is not None else 1
        computed_here = 0  # tokens this rank's forward passes ran on (its share of each stream under CP)
        aux_parts: list[torch.Tensor] = []  # this rank's parts of moe/aux_loss
        with deferred_finite_checks(), self.computing(), self._gathered_until_last(keep_gathered) as set_last:
            for i, mb in enumerate(micro_batches):
                set_last(i == len(micro_batches) - 1)
                recording = balance.recording(mb is not None) if balance else contextlib.nullcontext()
                with recording:
                    logp_bT, entropy_bT, num_tokens, num_response = self.run(batch, mb or [filler], options)
                if mb is None:
                    # Zero-weight filler: same collectives as a real micro-batch, no contribution.
                    (logp_bT.sum() * 0.0).backward()
                    continue
                loss_sum, mb_metrics = loss_fn(logp_bT, entropy_bT, torch.tensor(mb, dtype=torch.int64))
                check_loss_sum(loss_sum)
                loss = loss_sum.reshape(()) / loss_normalizer
                if balance is not None:
                    real_rows = functools.partial(self._real_rows, num_tokens)
                    aux = balance.aux_term(real_rows, self.layout.token_groups(), 1.0 / total_tokens)
                    if aux is not None:  # this rank's part of the whole micro-batch's (moe_balance.py)
                        loss = loss + balance.aux_loss_coef * aux
                        aux_parts.append(aux.detach())
                    balance.accumulate(self._padding_routed_here(num_tokens))
                loss.backward()
                computed_here += num_tokens
                records.append(weighted(mb_metrics, num_response))
                records.append(self._route_metrics(batch, mb))
                records.append(
                    {
                        "train/loss": Sum(loss_sum.detach() / loss_normalizer),
                        "train/tokens": Sum(sum(batch.samples[i].num_tokens for i in mb)),
                        "train/response_tokens": Sum(num_response),
                    }
                )
        if aux_parts:  # the parts of the ranks that split the tokens add up to the micro-batches' loss
            aux_loss = self.layout.summed_over_token_groups(torch.stack(aux_parts).sum(), self.device)
            records.append({"moe/aux_loss": Sum(aux_loss)})
        acc = MetricsAccumulator()
        acc.add_all(records)
        acc.add({"train/num_micro_batches": Max(len(micro_batches))})
        acc.add({"train/computed_tokens": Sum(self._summed_over_cp(computed_here))})
        return reduce_across_ranks(acc, self.layout.dp_group)

    def finish_moe(self, metrics: dict[str, float], *, applied: bool) -> dict[str, float]:
        """`metrics` with the MoE balance's end of step (`moe_step_metrics`)."""
        return metrics | moe_step_metrics(self.moe_balance, self.layout, self.device, applied=applied)

    def computing(self) -> contextlib.AbstractContextManager:
        """Forward and backward passes run inside: on one device below fp32, on the compute copies
        (`parallel.mixed_precision`); otherwise FSDP casts, and nothing is needed."""
        return self.copies.computing() if self.copies is not None else contextlib.nullcontext()

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

    def _summed_over_cp(self, count: int) -> int:
        """A count of what this rank computed, summed over its cp ranks (the whole micro-batches')."""
        if self.layout.cp == 1:
            return count
        total = torch.tensor([count], dtype=torch.float64, device=self.layout.comm_device(self.device))
        dist.all_reduce(total, group=self.layout.cp_group)
        return int(total.item())

    def _real_rows(self, num_tokens: int, num_rows: int) -> torch.Tensor:
        """[num_rows] bool: which of the rows this rank's MoE layers routed are real tokens (the
        last `_padding_routed_here` are padding)."""
        real = num_rows - self._padding_routed_here(num_tokens)
        return torch.arange(num_rows, device=self.device) < real

    def _padding_routed_here(self, num_tokens: int) -> int:
        """How many of the padding tokens (tp - 1 at most, at the end of the stream; under CP of this
        rank's share, `num_tokens` being what `run_micro_batch` says this rank computed) this rank's
        MoE layers routed, the last ones they saw: all under TP alone (every TP rank routes the whole
        stream); the overlap with its own token shard when each TP rank routes its shard."""
        pad = -num_tokens % self.layout.tp
        if not self.layout.tokens_split_over_tp:
            return pad
        shard = (num_tokens + pad) // self.layout.tp
        start = self.layout.tp_rank * shard
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
            counts = counts.to(self.layout.comm_device(self.device))
            dist.all_reduce(counts, group=self.layout.tp_group)
        if self.layout.cp > 1:  # each CP rank compared its own share of the stream
            counts = counts.to(self.layout.comm_device(self.device))
            dist.all_reduce(counts, group=self.layout.cp_group)
        compared = sum((len(batch.samples[i].routed_experts)) for i in rows) * len(self.model.moe_layers())
        return {"moe/route_mismatch_frac": Mean(counts[0] / counts[1].clamp(min=1), weight=compared)}


def moe_step_metrics(
    balance: MoEBalance | None, layout: EngineLayout, device: torch.device, *, applied: bool
) -> dict[str, float]:
    """The MoE balance's end of a step (`MoEBalance.finish`: the router bias update when the step was
    `applied`, the load metrics of the step); {} without MoE layers."""
    if balance is None:
        return {}
    comm_device = layout.comm_device(device) if layout.world_size > 1 else device
    return balance.finish(applied=applied, group=layout.moe_count_group, comm_device=comm_device)


def weighted(metrics: Mapping[str, Any], weight: int) -> dict[str, Metric]:
    """loss_fn metrics as Metric values: plain scalars become token-weighted means."""
    return {
        k: v if isinstance(v, Mean | Sum | Max | Min) else Mean(v, weight=weight) for k, v in metrics.items()
    }


def check_loss_sum(loss_sum: Any) -> None:
    if not isinstance(loss_sum, torch.Tensor) or loss_sum.numel() != 1:
        raise ValueError(
            f"loss_fn returned a loss of type {type(loss_sum).__name__} "
            f"{tuple(getattr(loss_sum, 'shape', ()))}; it must return a scalar tensor (the "
            "micro-batch's loss sum). Fix: return aggregate_loss_sum(loss_bT, mask_bT, mode)."
        )
