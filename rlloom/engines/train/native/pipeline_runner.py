"""`PipelineRunner`: the training engine's micro-batches through the stages of a
`rlloom.parallel.pp.Pipeline` (parallel.pp > 1), with the same two calls as runner.py's
`MicroBatchRunner`; pipeline.py holds the pieces it is made of.

Every micro-batch is padded to the token budget; the loss of each runs on the last stage's rank,
whose metrics every pp rank returns. MoE loads and route mismatches are counted by the stages (real
tokens only) and merged over the pp ranks; so is the MoE auxiliary loss (moe/aux_loss), which each
stage back-propagates for its own layers (`rlloom.parallel.pp_aux`).

Shape legend: B samples of the global batch, K selected positions, M pipeline micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from rlloom.algorithms._validate import deferred_finite_checks
from rlloom.config import ParallelConfig, TrainEngineConfig
from rlloom.data.types import RolloutBatch
from rlloom.engines.train.base import ForwardOptions, LossFn
from rlloom.engines.train.native.layout import EngineLayout
from rlloom.engines.train.native.moe_balance import MoEBalance, moe_layers_of
from rlloom.engines.train.native.pipeline import PipeBatch, from_last_stage, merge_moe_metrics, stage_view
from rlloom.engines.train.native.plan import computed_tokens
from rlloom.engines.train.native.policy import PolicyHead
from rlloom.engines.train.native.runner import check_loss_sum, moe_step_metrics, weighted
from rlloom.engines.train.native.value import ValueHead
from rlloom.observability.metrics import Max, Mean, Metric, MetricsAccumulator, Sum, reduce_across_ranks
from rlloom.parallel import ParallelDims
from rlloom.parallel.parallelize import parallelize_pp
from rlloom.parallel.pp import Pipeline


@dataclass(frozen=True, slots=True)
class PipelineRunner:
    """This rank's stages of the pipeline and how the engine runs its micro-batches through them."""

    pipe: Pipeline
    modules: list[nn.Module]
    """This rank's stage modules (FSDP2 on each): they hold its parameters."""
    module: nn.Module
    """A view of the stages under the PolicyHead's names (`pipeline.stage_view`)."""
    model: nn.Module
    """The view's CausalLM-like part (`module.model`)."""
    moe_balance: MoEBalance | None
    """This rank's MoE layers' balance (None when its stages have none)."""
    moe_model: bool
    """The whole model has MoE layers: every pp rank joins the load metrics' exchange."""
    num_moe_layers: int
    """MoE layers of the whole model (each pp rank holds some)."""
    device: torch.device
    layout: EngineLayout
    cfg: TrainEngineConfig

    @classmethod
    def build(
        cls,
        module: PolicyHead | ValueHead,
        dims: ParallelDims,
        cfg: TrainEngineConfig,
        *,
        pipeline: ParallelConfig,
        layout: EngineLayout,
        device: torch.device,
        param_dtype: torch.dtype,
        frozen: bool,
        sharded: bool,
        reshard_after_forward: bool,
    ) -> PipelineRunner:
        """Cut `module.model` into this rank's stages (`parallelize_pp`, with the pipeline settings of
        `pipeline`). `sharded` and `reshard_after_forward` are unused (the arguments are
        `MicroBatchRunner.build`'s): the stages are always FSDP-sharded."""
        model = module.model
        num_moe_layers = len(moe_layers_of(model))
        moe_model = not frozen and num_moe_layers > 0
        modules, pipe = parallelize_pp(
            model,
            dims,
            schedule=pipeline.schedule,
            virtual_stages=pipeline.pp_virtual_stages,
            first_stage_layers=pipeline.pp_first_stage_layers,
            last_stage_layers=pipeline.pp_last_stage_layers,
            budget=cfg.max_tokens_per_micro_batch,
            device=device,
            param_dtype=param_dtype,
            ac_mode="off" if frozen else cfg.activation_checkpointing,
            ac_every_k=cfg.ac_every_k,
            compile_layers=cfg.compile and device.type == "cuda",
            chunk_tokens=cfg.logprob_chunk_tokens,
            value_head=module.score if isinstance(module, ValueHead) else None,
        )
        view = stage_view(modules, model)  # the layers of other stages are freed with the whole model
        moe_balance = None
        if moe_model:  # this rank's MoE layers (None when its stages have none)
            # The stages compute the auxiliary loss themselves (`pp_stages`), not the balance.
            moe_balance = MoEBalance.build(
                view.model, aux_loss_coef=0.0, bias_update_rate=cfg.moe_bias_update_rate
            )
        pipe.feed.aux_loss_coef = cfg.moe_aux_loss_coef if moe_model else 0.0
        pipe.feed.token_groups = layout.token_groups()
        return cls(
            pipe=pipe,
            modules=modules,
            module=view,
            model=view.model,
            moe_balance=moe_balance,
            moe_model=moe_model,
            num_moe_layers=num_moe_layers,
            device=device,
            layout=layout,
            cfg=cfg,
        )

    def logprobs(
        self,
        batch: RolloutBatch,
        micro_batches: list[list[int] | None],
        filler: int,
        options: ForwardOptions,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logp_BT (entropy_BT) on the device: this dp rank's rows filled, 0 elsewhere (`filler` is
        unused: `PipeBatch` runs the fillers)."""
        logp_BT = torch.zeros(len(batch), batch.T, dtype=torch.float32, device=self.device)
        entropy_BT = torch.zeros_like(logp_BT) if options.with_entropy else None
        pb = PipeBatch.of(
            batch, micro_batches, share_prompts=self.cfg.share_prompts, replay_routes=options.routing_replay
        )
        out = self.pipe.forward_logprobs(
            pb.micro_batches,
            temperature=options.temperature,
            with_entropy=options.with_entropy,
            replay_routes=options.routing_replay,
        )
        for i, (logp_K, entropy_K) in enumerate(out):
            if pb.rows[i] is None:
                continue
            rows = torch.tensor(pb.rows[i], device=self.device)
            logp_BT[rows] = pb.spread(i, logp_K).to(self.device)
            if entropy_BT is not None:
                entropy_BT[rows] = pb.spread(i, entropy_K).to(self.device)
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
        """`loss_fn` runs on the last stage's rank, whose metrics (reduced over its dp ranks) every pp
        rank returns."""
        pb = PipeBatch.of(
            batch, micro_batches, share_prompts=self.cfg.share_prompts, replay_routes=options.routing_replay
        )
        records: list[dict[str, Metric]] = []

        def pipe_loss(i: int, logp_K: torch.Tensor, entropy_K: torch.Tensor | None) -> torch.Tensor:
            rows = pb.rows[i]
            entropy_bT = pb.spread(i, entropy_K) if entropy_K is not None else None
            loss_sum, mb_metrics = loss_fn(
                pb.spread(i, logp_K), entropy_bT, torch.tensor(rows, dtype=torch.int64)
            )
            check_loss_sum(loss_sum)
            num_response = int(pb.masks[i].sum())
            records.append(weighted(mb_metrics, num_response))
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
        feed = self.pipe.feed
        feed.moe_loads = {} if balance is not None else None
        if feed.aux_loss_coef > 0:  # each stage adds its layers' share (pp_aux.py)
            feed.aux_token_weight = 1.0 / (self.num_moe_layers * computed_tokens(batch, self.cfg))
            feed.aux_loss_sum = torch.zeros((), device=self.device)
        with_routes = self.num_moe_layers > 0 and batch.samples[0].routed_experts is not None
        if with_routes:
            m = self.pipe.num_micro_batches(len(micro_batches))
            feed.route_counts_M2 = torch.zeros(m, 2, device=self.device)
        try:
            with deferred_finite_checks():
                self.pipe.forward_backward(
                    pb.micro_batches,
                    pipe_loss,
                    temperature=options.temperature,
                    with_entropy=options.with_entropy,
                    replay_routes=options.routing_replay,
                )
            if balance is not None:  # the real tokens this rank's stages routed (padding not counted)
                balance.add_loads(torch.stack([feed.moe_loads[str(i)] for i in balance.layers]))
            if with_routes:
                records += self._route_metrics(batch, pb, feed.route_counts_M2)
            if feed.aux_loss_sum is not None:
                records.append({"moe/aux_loss": Sum(self._summed_over_token_shares(feed.aux_loss_sum))})
        finally:
            feed.moe_loads = feed.route_counts_M2 = feed.aux_loss_sum = None
        acc = MetricsAccumulator()
        acc.add_all(records)
        acc.add({"train/num_micro_batches": Max(len(micro_batches))})
        # Real tokens per token slot the pipeline computed (every micro-batch is padded to the budget).
        slots = self.pipe.num_micro_batches(len(micro_batches)) * self.pipe.budget
        acc.add({"perf/pp_budget_fill": Mean(sum(pb.num_tokens) / slots, weight=slots)})
        metrics = reduce_across_ranks(acc, self.layout.dp_group)
        return from_last_stage(self.pipe, metrics)

    def finish_moe(self, metrics: dict[str, float], *, applied: bool) -> dict[str, float]:
        """`metrics` with the MoE balance's end of step (`runner.moe_step_metrics`) and the load
        metrics of every pp rank's layers (`pipeline.merge_moe_metrics`)."""
        metrics = metrics | moe_step_metrics(self.moe_balance, self.layout, self.device, applied=applied)
        if self.moe_model:  # each pp rank holds some MoE layers
            metrics = merge_moe_metrics(self.pipe, metrics, self.moe_balance)
        return metrics

    def _route_metrics(
        self, batch: RolloutBatch, pb: PipeBatch, counts_M2: torch.Tensor
    ) -> list[dict[str, Metric]]:
        """`moe/route_mismatch_frac` per micro-batch as `MicroBatchRunner` gives it, from the counts
        each pp rank's stages recorded (summed over the pp ranks, and the TP/CP ranks that split
        tokens)."""
        counts_M2 = self._summed_over_token_shares(counts_M2)
        out = []
        for rows, (differ, compared) in zip(pb.rows, counts_M2.tolist()):
            if rows is None:
                continue
            weight = sum(len(batch.samples[i].routed_experts) for i in rows) * self.num_moe_layers
            out.append({"moe/route_mismatch_frac": Mean(differ / max(compared, 1.0), weight=weight)})
        return out

    def _summed_over_token_shares(self, value: torch.Tensor) -> torch.Tensor:
        """`value`, a sum over what this rank's MoE layers routed, summed over the ranks that route
        the rest of this dp rank's micro-batches: the pp ranks' layers (0 from a rank without MoE
        layers), and the TP/CP ranks that split the tokens."""
        value = value.to(self.layout.comm_device(self.device))
        dist.all_reduce(value, group=self.pipe.group)
        return self.layout.summed_over_token_groups(value, self.device)
