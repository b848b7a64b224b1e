"""The per-GPU and per-node memory model of one training layout (docs/plan.md derives every term).

`estimate(costs, layout, hardware, workload)` returns the predicted peak of every pipeline stage
in the training phase, the largest one's breakdown, host memory per node and the colocated
rollout's share. It models rlloom's training engine: FSDP2 keeps fp32 parameter shards (the
master weights) and fp32 gradient shards, gathers bf16 copies one layer at a time (plus one
prefetched) and keeps the root (embedding, head) gathered for the step; AdamW moments sit on the
GPU except for the offloaded fraction, whose master copy, moments and pinned gradient staging
live in host memory (CPU Adam). One GPU without optimizer offload runs without FSDP: whole fp32
masters and a bf16 copy of every parameter while it computes (phases.py). Forward-only models (the
teacher of on-policy distillation, the reward model) keep their weights in the compute dtype
(`frozen_gb`). Units: GB means 2**30 bytes throughout.
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
    the end of backward, every gradient present) or "teacher" (an offloaded teacher's forward, its
    weights beside the policy's states)."""

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
    # PPO's critic and the teacher are cut into the policy's stages: each pp rank keeps its layers' share
    shares = [len(r) / len(costs.layers) for r in stages]
    critic = [critic_state_gb(work.critic_params * f, layout) for f in shares]
    teacher = [frozen_gb(work.teacher_params * f, layout, work.compute_bytes) for f in shares]
    # the reward model, whole, on the trainer process's device: the first GPU (a stage-0 rank)
    reward = frozen_gb(work.reward_model_params, Layout(), work.compute_bytes)
    peaks_at = [
        _stage_peak(bd, phase, state, work, weights_kept + critic[s][0] + (reward if s == 0 else 0.0),
                    critic[s][1], kv_kept, teacher[s])
        for s, (bd, phase, _, state) in enumerate(results)
    ]  # fmt: skip
    peaks = [bd.total for bd, _ in peaks_at]
    worst = max(range(len(peaks)), key=peaks.__getitem__)
    breakdown, phase = peaks_at[worst]
    # Host per GPU: offloaded fp32 master + moments + pinned fp32 gradient staging of the trained
    # parameters; while the rollout runs, the training engine's GPU state (parameter shards and
    # moments) waits on the host;
    # while training runs, the rollout's weights do (unless they stay on the GPU).
    trained = max(p for _, _, p, _ in results)
    offloaded = 16 * layout.offload_fraction * trained
    during_rollout = max(state for *_, state in results) if rollout else 0.0
    during_train = rollout.weights_gb * GB if rollout and not work.rollout_weights_on_gpu else 0.0
    waiting_teacher = max(teacher) * GB if work.teacher_offload else 0.0  # offloaded: on the host
    host_per_gpu = (
        offloaded + waiting_teacher + max(during_rollout, during_train) + HOST_OVERHEAD_GB_PER_GPU * GB
    )
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


def _stage_peak(
    bd: Breakdown,
    phase: str,
    state: float,
    work: Workload,
    kept_params: float,
    kept_optimizer: float,
    kv_kept: float,
    teacher: float,
) -> tuple[Breakdown, str]:
    """A stage's peak and its phase, with what stays on the GPU beside the policy's step (`kept_*`:
    the rollout's weights, the critic's state, the reward model; `kv_kept`: the rollout's KV cache)
    and the teacher's weights (`teacher` GB): kept through the step, or with teacher.offload present
    only at its forward ("teacher" phase: the policy's parameter shards and moments, `state` bytes, no
    gradients or activations), which is the peak when the teacher outweighs them."""
    kept_teacher = 0.0 if work.teacher_offload else teacher
    train = replace(
        bd,
        params=bd.params + kept_params + kept_teacher,
        optimizer=bd.optimizer + kept_optimizer,
        buffers=bd.buffers + kv_kept,
    )
    if not (work.teacher_offload and teacher):
        return train, phase
    shards = state / GB - bd.optimizer  # the phases share one optimizer term: state = shards + it
    visit = Breakdown(shards + kept_params + teacher, 0.0, bd.optimizer + kept_optimizer, 0.0, kv_kept)
    return (visit, "teacher") if visit.total > train.total else (train, phase)


def frozen_gb(params: float, layout: Layout, compute_bytes: int) -> float:
    """GB that a forward-only model of `params` (under PP, a stage's share) keeps on each GPU: its
    weights in the compute dtype, sharded as the policy's are (tp x cp x dp; whole on one GPU), with no
    master copy, gradients or moments (engines/train/build.py, `frozen`). Its forward's working set
    (one gathered layer, one micro-batch's transient activations and logits chunk) is not counted:
    it exists only between the policy's steps, beside the policy's states alone."""
    return compute_bytes * params / (layout.tp * layout.cp * layout.dp) / GB


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
