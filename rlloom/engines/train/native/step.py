"""The optimizer step after the gradients of a global batch, and the step's performance metrics.

global grad norm, clip, AdamW: skipped when the loss or the norm is not finite (the engine's
decision), or when the step guard finds that a new parameter would not be finite
(`step_if_finite`, step_guard.py); a skipped step changes nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from rlloom.data.types import RolloutBatch
from rlloom.engines.train.native.flops import step_flops
from rlloom.engines.train.native.layout import EngineLayout
from rlloom.engines.train.native.optimizer import EngineOptimizer
from rlloom.engines.train.native.step_guard import SLACK, all_true
from rlloom.observability.memory import memory_metrics
from rlloom.observability.metrics import MetricsAccumulator, Min, reduce_across_ranks
from rlloom.observability.mfu import H100_BF16_PEAK_FLOPS
from rlloom.parallel import clip_grad_norm_
from rlloom.parallel.pp import Pipeline


def clip_grads(
    optimizer: EngineOptimizer,
    max_norm: float,
    *,
    pipe: Pipeline | None,
    expert_params: list[nn.Parameter],
    ep_group: dist.ProcessGroup | None,
) -> float:
    """Clip the gradients to `max_norm` by their global norm; return the norm before clipping."""
    if pipe is not None:  # once per step over the pp ranks (a tied embedding's two halves summed)
        return float(pipe.clip_grad_norm_(max_norm))
    return float(clip_grad_norm_(optimizer.params, max_norm, ep_params=expert_params, ep_group=ep_group))


def grad_max_after_clip(norm: float, max_norm: float) -> float:
    """A bound on every |gradient| after `clip_grads`: the global 2-norm (never below the largest
    element), clipped to `max_norm` when that is set, with SLACK for the scale's rounding."""
    return (min(norm, max_norm) if max_norm > 0 else norm) * SLACK


def step_if_finite(
    optimizer: EngineOptimizer, lr: float, layout: EngineLayout, device: torch.device, *, grad_max: float
) -> bool:
    """Apply the optimizer step only if every new parameter would be finite on every rank
    (step_guard.py: a bound on the update, else a trial of it slice by slice); otherwise change
    nothing and return False. `grad_max` bounds every |gradient| (`grad_max_after_clip`)."""
    optimizer.set_lr(lr)
    optimizer.stage_grads()
    guard = optimizer.guard
    flags = [guard.would_be_finite(optim, grad_max=grad_max) for optim in optimizer.optimizers]
    applied = all_true(flags, layout.world_group, device)
    if applied:
        optimizer.step()
    guard.settle(applied)
    return applied


def perf_metrics(
    batch: RolloutBatch,
    num_response: float,
    seconds: float,
    *,
    model: nn.Module,
    body_params: float,
    device: torch.device,
    layout: EngineLayout,
    pipelined: bool,
) -> dict[str, float]:
    """Throughput, step time and memory (reduced over every rank; under pipeline parallelism also the
    lightest rank's memory); on CUDA the MFU of an H100."""
    seq_lens = [s.num_tokens for s in batch.samples]
    out = {"perf/train_tok_per_s": sum(seq_lens) / seconds, "time/train_step_s": seconds}
    acc = MetricsAccumulator()
    memory = memory_metrics(device)
    acc.add(memory)
    if pipelined:  # pp ranks hold different layers: the lightest rank shows the imbalance
        acc.add({f"{k}_min_rank": Min(v.value) for k, v in memory.items()})
    out |= reduce_across_ranks(acc, layout.world_group)
    if device.type == "cuda":
        # The global batch's FLOPs over every device of the layout (pp x dp x tp x ...), not just
        # dp; under PP the padding to the token budget is not counted (it is no useful work).
        flops = step_flops(model, seq_lens, int(num_response), body_params=body_params)
        out["perf/mfu"] = flops / (seconds * H100_BF16_PEAK_FLOPS * layout.world_size)
    return out
