"""The per-GPU and per-node memory model of one training layout (docs/plan.md derives every term).

`estimate(costs, layout, hardware, workload)` returns the predicted peak of every pipeline stage
in the training phase, the largest one's breakdown, host memory per node and the colocated
rollout's share. It models rlloom's training engine: FSDP2 keeps fp32 parameter shards (the
master weights) and fp32 gradient shards, gathers bf16 copies one layer at a time (plus one
prefetched) and keeps the root (embedding, head) gathered for the step; AdamW moments sit on the
GPU except for the offloaded fraction, whose master copy, moments and pinned gradient staging
live in host memory (CPU Adam). One GPU without optimizer offload runs without FSDP: whole fp32
masters and a bf16 copy of every parameter while it computes (phases.py). Units: GB means 2**30 bytes throughout.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from rlloom.plan.counts import ModelCosts
from rlloom.plan.inputs import (
    HOST_OVERHEAD_GB_PER_GPU,
    RESERVED_GB,
    ROLLOUT_MEMORY_UTILIZATION,
    ROLLOUT_WEIGHTS_FRACTION,
    Hardware,
    Layout,
    Workload,
)
from rlloom.plan.phases import GB, Breakdown, stage_memory
from rlloom.plan.stages import stage_ranges


@dataclass(frozen=True, slots=True)
class RolloutMemory:
    model_parallel: int
    """GPUs one rollout replica's weights are sharded over (tensor and expert parallel)."""
    weights_gb: float
    kv_cache_gb: float
    kv_cache_tokens: int
    """Tokens whose KV cache fits on one GPU of a replica."""


@dataclass(frozen=True, slots=True)
class Estimate:
    layout: Layout
    breakdown: Breakdown
    """The peak stage's parts."""
    stage_peaks_gb: tuple[float, ...]
    cpu_memory_gb_per_node: float
    rollout: RolloutMemory | None
    problems: tuple[str, ...] = field(default=())
    """Why it does not fit; empty when it fits."""
    peak_phase: str = "head"
    """When the peak stage peaks: "head" (the logprob head's backward, every activation still
    saved), "layers" (a decoder layer's backward) or "reduce" (the root unit's gradient reduce at
    the end of backward, every gradient present)."""

    @property
    def gpu_memory_gb(self) -> float:
        return max(self.stage_peaks_gb)

    @property
    def fits(self) -> bool:
        return not self.problems


def rollout_memory(costs: ModelCosts, hw: Hardware, work: Workload) -> RolloutMemory | None:
    """Weights and KV cache per GPU of the colocated rollout (None when there is no rollout)."""
    if not work.colocated_rollout:
        return None
    weights = 2 * costs.total_params
    if work.rollout_quantization == "fp8":  # rlloom/models/fp8.py: the experts at 1 + 4/128 bytes
        weights -= (2 - 1 - 4 / 128) * costs.expert_params
    group = work.rollout_model_parallel or 1
    while (
        not work.rollout_model_parallel and weights / group > ROLLOUT_WEIGHTS_FRACTION * hw.gpu_memory_gb * GB
    ):
        if group >= hw.gpus:
            break
        group *= 2
    group = min(group, hw.gpus)
    kv_per_token = sum(c.kv_bytes_per_token for c in costs.layers)
    if not costs.mla:  # GQA heads are split over tensor parallelism
        kv_per_token /= min(group, costs.num_kv_heads)
    kv = max(0.0, ROLLOUT_MEMORY_UTILIZATION * (hw.gpu_memory_gb - RESERVED_GB) * GB - weights / group)
    if work.rollout_kv_cache_gb:
        kv = work.rollout_kv_cache_gb * GB
    return RolloutMemory(group, weights / group / GB, kv / GB, int(kv / kv_per_token))


def estimate(costs: ModelCosts, layout: Layout, hw: Hardware, work: Workload) -> Estimate:
    """Predicted memory of `layout`; `problems` says what does not fit."""
    stages = stage_ranges(
        len(costs.layers), layout.pp, layout.pp_first_stage_layers, layout.pp_last_stage_layers
    )
    if layout.pp > 1:
        layout = replace(layout, pp_first_stage_layers=len(stages[0]), pp_last_stage_layers=len(stages[-1]))
    results = [stage_memory(costs, r, s, layout, work) for s, r in enumerate(stages)]
    rollout = rollout_memory(costs, hw, work)
    # what the rollout keeps on the GPU while training: its weights (params), its KV cache (buffers)
    weights_kept = rollout.weights_gb if rollout and work.rollout_weights_on_gpu else 0.0
    kv_kept = rollout.kv_cache_gb if rollout and work.rollout_kv_on_gpu else 0.0
    # PPO's critic is cut into the policy's stages: each pp rank keeps its layers' share
    critic = [critic_state_gb(work.critic_params * len(r) / len(costs.layers), layout) for r in stages]
    kept = weights_kept + kv_kept
    peaks = [bd.total + kept + sum(critic[s]) for s, (bd, *_) in enumerate(results)]
    worst = max(range(len(peaks)), key=peaks.__getitem__)
    breakdown, phase, *_ = results[worst]
    critic_params, critic_optimizer = critic[worst]
    breakdown = replace(
        breakdown,
        params=breakdown.params + weights_kept + critic_params,
        optimizer=breakdown.optimizer + critic_optimizer,
        buffers=breakdown.buffers + kv_kept,
    )
    # Host per GPU: offloaded fp32 master + moments + pinned fp32 gradient staging of the trained
    # parameters; while the rollout runs, the training engine's GPU state (parameter shards and
    # moments) waits on the host;
    # while training runs, the rollout's weights do (unless they stay on the GPU).
    trained = max(p for _, _, p, _ in results)
    offloaded = 16 * layout.offload_fraction * trained
    during_rollout = max(state for *_, state in results) if rollout else 0.0
    during_train = rollout.weights_gb * GB if rollout and not work.rollout_weights_on_gpu else 0.0
    host_per_gpu = offloaded + max(during_rollout, during_train) + HOST_OVERHEAD_GB_PER_GPU * GB
    host = host_per_gpu * min(hw.gpus_per_node, hw.gpus) / GB
    return Estimate(
        layout=layout,
        breakdown=breakdown,
        stage_peaks_gb=tuple(peaks),
        cpu_memory_gb_per_node=host,
        rollout=rollout,
        problems=tuple(_problems(max(peaks), host, rollout, hw, work)),
        peak_phase=phase,
    )


def critic_state_gb(critic_params: float, layout: Layout) -> tuple[float, float]:
    """(weights, AdamW moments) in GB that PPO's critic (`critic_params` of it: under PP, a stage's
    share) keeps on each GPU while the policy trains:
    fp32 master shards (one GPU without FSDP: the whole fp32 model; its bf16 compute copies live
    only during its own step) and the moments not offloaded. Its own training step peaks like the
    policy's with the policy's state kept instead; for a critic no larger than the policy (the
    default: the same checkpoint, whose value head is smaller than the lm head) the policy's step is
    the larger of the two."""
    if critic_params <= 0:
        return 0.0, 0.0
    per_gpu = critic_params / (layout.tp * layout.cp * layout.dp)
    return 4 * per_gpu / GB, 8 * (1 - layout.offload_fraction) * per_gpu / GB


def _problems(
    peak: float, host: float, rollout: RolloutMemory | None, hw: Hardware, work: Workload
) -> list[str]:
    out = []
    if peak > hw.usable_gpu_gb:
        out.append(
            f"training needs {peak:.1f} GB per GPU, {hw.usable_gpu_gb:.1f} GB usable of {hw.gpu_memory_gb:g} GB"
        )
    if hw.cpu_memory_gb_per_node and host > hw.cpu_memory_gb_per_node:
        out.append(f"host memory {host:.0f} GB per node exceeds {hw.cpu_memory_gb_per_node:g} GB")
    # A KV cache the planner sizes must hold one micro-batch; one the user sized is their choice.
    planned_kv = rollout is not None and not work.rollout_kv_cache_gb
    if planned_kv and rollout.kv_cache_tokens < work.max_tokens_per_gpu:
        out.append(
            f"rollout weights take {rollout.weights_gb:.1f} GB per GPU over {rollout.model_parallel} GPUs, "
            f"leaving KV cache for {rollout.kv_cache_tokens} tokens < {work.max_tokens_per_gpu}"
        )
    return out
