"""NativeTrainEngine: the PyTorch training engine (bf16 compute, fp32 master weights) in any layout
of TP/SP, EP, CP, FSDP2 and PP that `rlloom.parallel` builds; the engine itself only knows the few
facts of `EngineLayout` (layout.py). This class orchestrates; each part is a module beside it.

One call of `train_step` is one optimizer step over a global batch:

    plan     (plan.py, microbatch.py) balance samples over data-parallel ranks by tokens, pack each
             rank's share into micro-batches of at most max_tokens_per_micro_batch tokens (no
             padding, no truncation); with share_prompts the packing units are groups (one prompt
             copy + its responses). The TP ranks of one dp rank run the same micro-batches (padded to
             a multiple of tp); so do its CP ranks, each on its share of every stream (parallel/cp.py)
    run      (runner.py; pipeline_runner.py under parallel.pp > 1) per micro-batch: packed forward,
             logprobs at response positions, the caller's loss_fn, backward of loss_sum /
             loss_normalizer (gradients accumulate; FSDP sums them over ranks)
    step     (step.py) global grad norm, clip, AdamW (skipped when the loss or the norm is not finite,
             or when a trial of the update finds that a new parameter would not be finite:
             step_guard.py); then the MoE balance's end of step (router bias update, load metrics)

Checkpoints, offload and onload are state.py's; the weight export for weight sync is weights.py's.

Every rank receives the same global batch and computes the same plan from it, so no plan is sent.
Ranks with fewer micro-batches run zero-weight copies of their smallest sample, so every rank issues
the same collectives. Because each micro-batch's loss sum is divided by the normaliser of the
global batch and gradients are summed, loss and gradients equal those of the whole batch at once,
for any token budget and any layout (the normaliser counts the tokens of every dp rank's samples;
TP ranks hold the same samples and are not counted again).

Shape legend: B samples of the global batch, b of a micro-batch, T response tokens (batch.T).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import time
from collections.abc import Iterator, Mapping
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from rlloom.config import ParallelConfig, TrainEngineConfig
from rlloom.config.train import shares_prompts
from rlloom.data.types import RolloutBatch
from rlloom.engines.train.base import PLAIN_FORWARD, ForwardOptions, LossFn, WeightLayout
from rlloom.engines.train.native.checkpoint import EXPERTS
from rlloom.engines.train.native.flops import active_body_params
from rlloom.engines.train.native.layout import EngineLayout
from rlloom.engines.train.native.lr_schedule import lr_at
from rlloom.engines.train.native.optimizer import EngineOptimizer
from rlloom.engines.train.native.pipeline import pipeline_weight_layouts
from rlloom.engines.train.native.pipeline_runner import PipelineRunner
from rlloom.engines.train.native.plan import plan_batch
from rlloom.engines.train.native.policy import PolicyHead
from rlloom.engines.train.native.runner import MicroBatchRunner
from rlloom.engines.train.native.state import load_state, move_state, save_state
from rlloom.engines.train.native.step import clip_grads, grad_max_after_clip, perf_metrics, step_if_finite
from rlloom.engines.train.native.value import ValueHead
from rlloom.engines.train.native.weights import named_weight_buckets, weight_layouts
from rlloom.models import from_pretrained
from rlloom.models.checkpoint import value_model_from_pretrained
from rlloom.models.lora import apply_lora, has_lora, merged_state
from rlloom.observability.memory import reset_peak_memory
from rlloom.parallel import ParallelDims, init_distributed
from rlloom.parallel.cp import check_cp_layout
from rlloom.parallel.pp import Pipeline
from rlloom.parallel.tp_shard import exported


def _shards(
    cfg: TrainEngineConfig, parallel_dims: ParallelDims | None, *, frozen: bool, compute_dtype: torch.dtype
) -> bool:
    """Whether FSDP2 wraps the model. One device computes below fp32 on bf16 copies of its whole fp32
    model, without FSDP (parallel/mixed_precision.py: faster); FSDP2 shards, casts and reduces across
    ranks, and on one device too when the run offloads its optimizer to save GPU memory (FSDP's
    copies are one layer at a time: 2 bytes a parameter less at the peak)."""
    world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    lean = cfg.optimizer_offload and not frozen and compute_dtype != torch.float32
    return world_size > 1 or parallel_dims is not None or lean


def _master_weights(
    model: nn.Module, cfg: TrainEngineConfig, *, compute_dtype: torch.dtype, frozen: bool, head: str
) -> nn.Module:
    """`model` in the dtypes it trains in, with LoRA adapters when cfg.lora_rank asks (policy only).
    Trained parameters are the fp32 master weights; a frozen reference keeps the compute dtype."""
    if frozen:
        return model.to(compute_dtype).requires_grad_(False)
    model = model.float()
    if cfg.lora_rank and head == "policy":
        apply_lora(model, rank=cfg.lora_rank, alpha=cfg.lora_alpha, targets=cfg.lora_target_modules)
        # A frozen weight needs no fp32 master: it is kept in the compute dtype (2 bytes a
        # parameter instead of 4, and on one device no compute copy each step). FSDP2 shards
        # and gathers it as it is; only the trained adapters must share one dtype in a unit.
        with torch.no_grad():
            for p in model.parameters():
                if not p.requires_grad:
                    p.data = p.data.to(compute_dtype)
    if cfg.freeze_vision and getattr(model, "visual", None) is not None:
        model.visual.requires_grad_(False)  # no gradient, no optimizer state: the tower stays as loaded
    return model


class NativeTrainEngine:
    """Training engine over a native CausalLM; see the module docstring for one step's anatomy.

    `model`: a native CausalLM (fp32 weights on CPU or `device`). `dtype`: compute dtype (default
    bf16 on CUDA, fp32 on CPU). With more than one rank (an initialised process group, or torchrun
    variables WORLD_SIZE/RANK/MASTER_ADDR/MASTER_PORT) or `parallel_dims`, the model is parallelised
    in that layout (`pipeline`: the pipeline settings of the `parallel` section, used when
    parallel_dims.pp > 1) (default: FSDP2 over every rank). One process without `parallel_dims`
    keeps its fp32 masters unsharded and runs forward and backward on compute-dtype copies
    (`rlloom.parallel.mixed_precision`), unless it offloads its optimizer (then FSDP2 on one rank,
    which holds the compute-dtype copies one layer at a time). `total_steps`: optimizer steps of the run,
    needed by the linear and cosine LR schedules. `frozen`: a forward-only reference (`build_reference`).
    `head`: `policy` (logprobs of the response tokens) or `value` (the critic of PPO: `ValueHead`'s
    values at the same positions, through `forward_values`; the loss function gets them in place of
    logprobs); `value_score`: the value head's starting tensors (`value_model_from_pretrained`).
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
        head: Literal["policy", "value"] = "policy",
        value_score: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        self.cfg = cfg
        self.head = head
        self.device = torch.device(device)
        self.compute_dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.total_steps = total_steps
        self.pipeline_settings = pipeline or ParallelConfig()
        """The `parallel` section's pipeline settings (pp_schedule, pp_virtual_stages, stage sizes)."""
        self.frozen = frozen
        """A forward-only reference: weights in the compute dtype, no gradients, no optimizer."""
        lr_at(0, cfg, total_steps)  # fail now, not at the first step, on a schedule without total_steps
        self.sharded = _shards(cfg, parallel_dims, frozen=frozen, compute_dtype=self.compute_dtype)

        self.model = _master_weights(model, cfg, compute_dtype=self.compute_dtype, frozen=frozen, head=head)
        self._body_params = active_body_params(self.model)  # before expert parallelism splits experts
        self.module = (
            ValueHead(self.model, value_score)
            if head == "value"
            else PolicyHead(
                self.model, chunk_tokens=cfg.logprob_chunk_tokens, fused_head=self.device.type == "cuda"
            )
        )
        self.reshard_after_forward = reshard_after_forward
        self.dims: ParallelDims | None = None
        if self.sharded:
            init_distributed(self.device.type)  # also picks this rank's GPU (LOCAL_RANK)
            self.dims = parallel_dims or ParallelDims(world_size=dist.get_world_size())
            self.dims.build_mesh(self.device.type)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        layout = self.layout = EngineLayout.of(self.dims)
        check_cp_layout(layout.cp, cfg.share_prompts)
        cfg = self.cfg = dataclasses.replace(cfg, share_prompts=shares_prompts(cfg.share_prompts, layout.cp))
        # Under pipeline parallelism `self.module` becomes a view of this rank's stages under the
        # PolicyHead's names and `self.model` its CausalLM-like part (other stages' layers are freed).
        pipelined = self.dims is not None and self.dims.pp > 1
        build = PipelineRunner.build if pipelined else MicroBatchRunner.build
        runner = self._runner = build(
            self.module,
            self.dims,
            cfg,
            pipeline=self.pipeline_settings,
            layout=layout,
            device=self.device,
            param_dtype=self.compute_dtype,
            frozen=frozen,
            sharded=self.sharded,
            reshard_after_forward=reshard_after_forward,
        )
        """Runs this rank's micro-batches: through the pipeline's stages, or the one parallelised model."""
        self.module, self.model, self.moe_balance = runner.module, runner.model, runner.moe_balance
        self.pipe: Pipeline | None = runner.pipe if isinstance(runner, PipelineRunner) else None
        """The pipeline runner under pipeline parallelism (parallel.pp > 1), else None."""
        self.dp_group, self.dp_rank, self.dp_size = layout.dp_group, layout.dp_rank, layout.dp_size
        named = list(self.module.named_parameters())
        self._expert_params = [p for name, p in named if EXPERTS in name] if layout.ep_group else []
        trained = [(name, p) for name, p in named if p.requires_grad]  # LoRA freezes the base weights
        self._optimizer = None if frozen else EngineOptimizer(trained, cfg)
        self.version = 0
        """Optimizer steps applied so far: the policy version of the current weights."""
        self.num_skipped_steps = 0

    def _set_mode(self, train: bool) -> None:
        for module in self._runner.modules:
            module.train(train)

    @property
    def optimizer(self) -> EngineOptimizer:
        if self._optimizer is None:
            raise ValueError(
                "this engine is a frozen reference (build_reference): it has no optimizer and cannot train "
                "or be saved. Fix: train and save the policy engine (build_train_engine)."
            )
        return self._optimizer

    @property
    def ep_rank(self) -> int:
        """This rank's expert-parallel rank (0 without expert parallelism)."""
        return self.layout.ep_rank

    @property
    def tp_rank(self) -> int:
        """This rank's tensor-parallel rank (0 without tensor parallelism)."""
        return self.layout.tp_rank

    @classmethod
    def build(cls, cfg: TrainEngineConfig, model_path: str, **kwargs: Any) -> NativeTrainEngine:
        """Load a Hugging Face checkpoint folder (or the embedded model name) in fp32 on CPU and build;
        a critic (head `value`) from a causal LM or from a value or reward model with its head."""
        if kwargs.get("head") == "value":
            model, score = value_model_from_pretrained(model_path, dtype=torch.float32, device="cpu")
            return cls(cfg, model, value_score=score, **kwargs)
        return cls(cfg, from_pretrained(model_path, dtype=torch.float32, device="cpu"), **kwargs)

    # ---- the engine interface ---------------------------------------------------------------

    @torch.no_grad()
    def forward_logprobs(
        self, batch: RolloutBatch, options: ForwardOptions = PLAIN_FORWARD
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logprobs (and entropies) of the batch's response tokens: fp32 [B, T] on CPU, 0 where masked.

        Every data-parallel rank passes the same global batch and gets the whole result. With
        `options.routing_replay` an MoE model routes each token to the experts the rollout recorded.
        """
        self._expect_head("policy", "forward_logprobs")
        return self._forward(batch, options)

    @torch.no_grad()
    def forward_values(self, batch: RolloutBatch) -> torch.Tensor:
        """A critic's (head `value`) values before each response token: fp32 [B, T] on CPU, 0 where
        masked; every data-parallel rank gets the whole result. An MoE critic routes by itself."""
        self._expect_head("value", "forward_values")
        return self._forward(batch, PLAIN_FORWARD)[0]

    def _expect_head(self, head: str, method: str) -> None:
        if self.head != head:
            raise ValueError(f"{method} needs an engine with head={head!r}; this one has head={self.head!r}")

    def _forward(
        self, batch: RolloutBatch, options: ForwardOptions
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        self._set_mode(False)
        micro_batches, filler = plan_batch(batch, self.cfg, self.layout, self.device)
        logp_BT, entropy_BT = self._runner.logprobs(batch, micro_batches, filler, options)
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
        options: ForwardOptions = PLAIN_FORWARD,
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
        micro_batches, filler = plan_batch(batch, self.cfg, self.layout, self.device)
        return self._runner.forward_backward(
            batch,
            micro_batches,
            filler,
            loss_fn,
            loss_normalizer=loss_normalizer,
            options=options,
        )

    def train_step(
        self,
        batch: RolloutBatch,
        loss_fn: LossFn,
        *,
        loss_normalizer: float,
        options: ForwardOptions = PLAIN_FORWARD,
    ) -> dict[str, float]:
        """One optimizer step on the global batch; returns the step's metrics (same on every rank)."""
        reset_peak_memory(self.device)
        start = time.perf_counter()
        metrics = self.forward_backward(batch, loss_fn, loss_normalizer=loss_normalizer, options=options)
        lr = lr_at(self.version, self.cfg, self.total_steps)
        grad_norm = clip_grads(
            self.optimizer,
            self.cfg.grad_clip,
            pipe=self.pipe,
            expert_params=self._expert_params,
            ep_group=self.layout.ep_group,
        )
        finite = math.isfinite(grad_norm) and math.isfinite(metrics.get("train/loss", 0.0))
        grad_max = grad_max_after_clip(grad_norm, self.cfg.grad_clip)
        skip = not (
            finite and step_if_finite(self.optimizer, lr, self.layout, self.device, grad_max=grad_max)
        )
        if skip:  # never applied: no update, no version bump, and so never saved
            self.num_skipped_steps += 1
        else:
            self.version += 1
        self.optimizer.zero_grad()
        metrics = self._runner.finish_moe(metrics, applied=not skip)  # the router bias update, loads
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        metrics |= {"train/grad_norm": grad_norm, "train/lr": lr, "train/skipped_step": float(skip)}
        metrics |= perf_metrics(
            batch,
            metrics["train/response_tokens"],
            seconds,
            model=self.model,
            body_params=self._body_params,
            device=self.device,
            layout=self.layout,
            pipelined=self.pipe is not None,
        )
        return metrics

    def named_weights(
        self,
        *,
        bucket_bytes: int = 1 << 29,
        dtype: torch.dtype | None = None,
        owned_only: bool = False,
        lazy_cast: bool = False,
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Buckets of (Hugging Face name, full tensor) for weight sync; version is `self.version`.

        Gathers shards: every rank must consume the generator. `owned_only`: nothing is gathered over
        the EP or TP ranks, this rank yields only its own routed experts and its TP shard of each
        tensor-parallel tensor (`weights.named_weight_buckets`).
        `lazy_cast`: a tensor that no gather moves (one rank's, or one process's) comes in its own
        dtype, for a caller whose copy casts it (the weight syncs): one pass instead of a cast and a copy.
        A critic (head `value`) ends with a bucket of its value head
        under the names of transformers' *ForTokenClassification (`score.weight`, `score.bias`).
        """
        tensors = None
        if self.pipe is not None:  # every stage's tensors on every pp rank (LoRA's merged)
            tensors = self.pipe.full_weights(tp_local_shards=owned_only)
        elif has_lora(self.model):  # the rollout and Hugging Face folders get the merged weights
            tensors = merged_state(self.model.state_dict(), self.model)
        head: dict[str, torch.Tensor] = {}
        if tensors is not None and self.head == "value":  # the pipeline's value head comes apart
            tensors = _split_off(tensors, "score.", head)
        buckets = named_weight_buckets(
            self.model,
            bucket_bytes=bucket_bytes,
            dtype=dtype,
            lazy_cast=lazy_cast,
            ep_group=self.layout.ep_group,
            tensors=tensors,
            owned_only=owned_only,
        )
        return (
            itertools.chain(buckets, self._value_head_bucket(dtype, head))
            if self.head == "value"
            else buckets
        )

    def _value_head_bucket(
        self, dtype: torch.dtype | None, from_pipeline: dict[str, torch.Tensor]
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The value head's tensors: gathered here, or under PP those the pipeline's last stage
        broadcast (`from_pipeline`, filled once the body's buckets are consumed)."""
        if self.pipe is not None:
            yield [(name, t.to(dtype or t.dtype)) for name, t in from_pipeline.items()]
            return
        yield [(f"score.{n}", exported(p, False, dtype)) for n, p in self.module.score.named_parameters()]

    def weight_layouts(self) -> dict[str, WeightLayout]:
        """For each Hugging Face name `named_weights` yields, where it lives on this rank (native
        parameter, full shape, expert index and EP owner, DTensor mesh dimensions and placements,
        the TP shard `named_weights(owned_only=True)` yields);
        no data moves. This rank's EP rank is `ep_rank`. Under pipeline parallelism
        `named_weights` gives every rank every stage's tensors, so this describes them all: each
        stage's as its own ranks hold it (an expert's EP rank is the same on every pp rank), in the
        order `named_weights` yields them (collective over the pp group)."""
        if self.pipe is None:
            return weight_layouts(self.model, ep=self.layout.ep)
        return pipeline_weight_layouts(self.pipe, ep=self.layout.ep)

    # ---- checkpoint and memory --------------------------------------------------------------

    def save(self, path: str) -> None:
        """Save model, optimizer, schedule position and RNG states to the folder `path` (all ranks)."""
        state = {"version": self.version, "num_skipped_steps": self.num_skipped_steps}
        save_state(path, self.module, self.optimizer, state, layout=self.layout, device=self.device)

    def load(self, path: str) -> None:
        """Restore a `save`d folder into this engine (built with the same model and settings)."""
        state = load_state(path, self.module, self.optimizer, layout=self.layout)
        self.version = int(state["version"])
        self.num_skipped_steps = int(state["num_skipped_steps"])

    def offload(self) -> None:
        """Move parameters, gradients and optimizer state to CPU (frees the GPU for rollout)."""
        move_state(self._runner.modules, self._optimizer, torch.device("cpu"), self.device)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def onload(self) -> None:
        """Move everything `offload` moved back to the engine's device."""
        move_state(self._runner.modules, self._optimizer, self.device, self.device)


def _split_off(
    tensors: Iterator[tuple[str, torch.Tensor]], prefix: str, into: dict[str, torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """`tensors` without the names starting with `prefix`, which go `into` as they pass."""
    for name, tensor in tensors:
        if name.startswith(prefix):
            into[name] = tensor
        else:
            yield name, tensor
