"""The per-GPU and per-node memory model of one training layout (docs/plan.md derives every term).

`estimate(costs, layout, hardware, workload)` returns the predicted peak of every pipeline stage
in the training phase, the largest one's breakdown, host memory per node and the colocated
rollout's share. It models rlloom's training engine: FSDP2 keeps fp32 parameter shards (the
master weights) and fp32 gradient shards, gathers bf16 copies one layer at a time (plus one
prefetched) and keeps the root (embedding, head) gathered for the step; AdamW moments sit on the
GPU except for the offloaded fraction, whose master copy, moments and pinned gradient staging
live in host memory (CPU Adam). Units: GB means 2**30 bytes throughout.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from rlloom.plan.counts import LayerCost, ModelCosts
from rlloom.plan.stages import layer_kinds, stage_ranges

GB = float(1 << 30)
Recompute = Literal["full", "selective", "none"]
RESERVED_GB = 2.0
"""Per-GPU memory that is not the allocator's: CUDA context, NCCL, cuBLAS workspaces."""
FRAGMENTATION = 0.05
"""Fraction of the rest lost to allocator fragmentation."""
NCCL_BUFFERS_GB = 0.5
"""Communication buffers of NCCL when more than one GPU takes part."""
HOST_OVERHEAD_GB_PER_GPU = 24.0
"""Host memory of one GPU's worker process besides model state (Python, torch, CUDA host side,
rollout engine, data)."""
ROLLOUT_WEIGHTS_FRACTION = 0.5
"""The rollout shards its weights over the fewest GPUs (a power of two) that keep them under this
fraction of a GPU, as verl does (tensor parallel 32 for DeepSeek-V3 on 96 GB)."""
EAGER_ACTIVATION_FACTOR = 1.45
"""Saved activations of an eager (not compiled) decoder layer over the counted ones: eager keeps the
norms' fp32 intermediates, the SiLU output, RoPE tables and attention layout copies (measured with
saved-tensor hooks, tests/plan/test_plan_activations.py: 1.24-1.49)."""
ROLLOUT_MEMORY_UTILIZATION = 0.85
"""Fraction of a GPU the rollout engine takes for weights plus KV cache."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    """One way to lay the model out on the GPUs; `world = tp * pp * cp * dp`."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    """Expert-parallel degree, drawn from the tp * cp * dp ranks of a stage (expert TP is 1)."""
    dp: int = 1
    offload_fraction: float = 0.0
    """Fraction of each GPU's parameters whose master weights and AdamW moments live on the host."""
    pp_first_stage_layers: int = 0
    """Decoder layers on the first stage; 0 splits evenly (middle stages share the rest)."""
    pp_last_stage_layers: int = 0
    """Decoder layers on the last stage; 0 splits evenly."""

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def short(self) -> str:
        stages = ""
        if self.pp > 1:
            stages = f" stages={self.pp_first_stage_layers}/../{self.pp_last_stage_layers}"
        return (
            f"tp={self.tp} pp={self.pp} cp={self.cp} ep={self.ep} dp={self.dp} "
            f"offload={self.offload_fraction:g}{stages}"
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Hardware:
    gpus: int
    gpu_memory_gb: float
    gpus_per_node: int = 8
    cpu_memory_gb_per_node: float = 0.0
    """Host memory per node; 0 means unknown (not checked)."""

    @property
    def usable_gpu_gb(self) -> float:
        return (self.gpu_memory_gb - RESERVED_GB) * (1.0 - FRAGMENTATION)


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    max_tokens_per_gpu: int = 8192
    """Tokens of one micro-batch of one model replica (split over its TP and CP ranks)."""
    recompute: Recompute = "full"
    recompute_every_k: int = 1
    """With full recompute: checkpoint every k-th layer (rlloom's activation_checkpointing=every_k)."""
    logprob_chunk_tokens: int = 4096
    compiled: bool = True
    """Decoder layers run torch.compile'd (rlloom's default on CUDA); eager ones save more."""
    colocated_rollout: bool = True
    """A rollout engine shares the GPUs; it needs its weights and a KV cache between training steps."""
    rollout_weights_on_gpu: bool = False
    """The rollout keeps a full bf16 weight copy on each GPU while training (rlloom today); False:
    its weights are offloaded to the host during training (verl, slime)."""
    rollout_model_parallel: int = 0
    """GPUs a rollout replica is sharded over; 0 picks the fewest that keep its weights under
    ROLLOUT_WEIGHTS_FRACTION of a GPU."""
    rollout_kv_cache_gb: float = 0.0
    """The rollout's KV-cache memory per GPU; 0 takes what ROLLOUT_MEMORY_UTILIZATION leaves."""
    rollout_kv_on_gpu: bool = False
    """The KV cache stays allocated while training (rlloom's rollout.sleep_during_train=false)."""


@dataclass(frozen=True, slots=True)
class Breakdown:
    """GB of one GPU at the training peak."""

    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers


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

    @property
    def gpu_memory_gb(self) -> float:
        return max(self.stage_peaks_gb)

    @property
    def fits(self) -> bool:
        return not self.problems


def _saved_per_token(layer: LayerCost, hidden: int, work: Workload, checkpointed: bool) -> int:
    if work.recompute == "none" or (work.recompute == "full" and not checkpointed):
        return layer.act_none
    if work.recompute == "selective":
        return layer.act_selective
    return hidden  # full recompute keeps only the layer's input


def _stage_memory(
    costs: ModelCosts, layers: range, stage: int, layout: Layout, work: Workload
) -> tuple[Breakdown, float]:
    """(peak breakdown, parameters per GPU) of one stage."""
    is_first, is_last = stage == 0, stage == layout.pp - 1
    shard = layout.tp * layout.cp * layout.dp  # FSDP x TP (dense) = EP x expert FSDP (experts)
    present = layer_kinds(costs, layers)
    root = (costs.embed_params if is_first else 0) + (costs.head_params if is_last else 0)
    if costs.tied and is_first and is_last:  # one tensor is both the embedding and the head
        root -= costs.embed_params
    stage_params = sum(n * (c.dense_params + c.expert_params) for c, n in present) + root
    per_gpu = stage_params / shard
    gathered_layer = max(c.dense_params / layout.tp + c.expert_params / layout.ep for c, _ in present)
    gathered_root = root / layout.tp
    head_per_gpu = costs.vocab_size * costs.hidden_size / layout.tp if is_last else 0.0

    f = layout.offload_fraction
    # fp32 shard + bf16 root kept gathered for the step + two gathered layers (current, prefetch)
    params = 4 * per_gpu + 2 * gathered_root + 2 * 2 * gathered_layer
    # fp32 shard + one layer's unsharded bf16 grads and fp32 reduce-scatter input + the head's fp32
    # weight-gradient accumulator (logprob head) and the root's bf16/fp32 copies at its backward
    grads = 4 * per_gpu + 6 * gathered_layer + (4 + 6) * head_per_gpu
    optimizer = 8 * (1 - f) * per_gpu

    t = work.max_tokens_per_gpu / (layout.tp * layout.cp)  # tokens per GPU (sequence parallel)
    in_flight = layout.pp - stage  # 1F1B: the first stage holds pp micro-batches
    if work.recompute_every_k == 1:
        saved = sum(n * _saved_per_token(c, costs.hidden_size, work, True) for c, n in present)
    else:  # every k-th layer of the stage is checkpointed
        saved = sum(
            _saved_per_token(
                costs.layers[i], costs.hidden_size, work, (i - layers.start) % work.recompute_every_k == 0
            )
            for i in layers
        )
    largest = max(c.act_none for c, _ in present)
    working = largest * (1.5 if work.recompute == "full" else 0.5)  # recomputed layer + its grads
    activations = 2 * t * (saved * in_flight + working) * (1.0 if work.compiled else EAGER_ACTIVATION_FACTOR)
    if is_first:
        activations += 2 * t * costs.hidden_size * in_flight  # embedding output

    buffers = 0.0
    seq = work.max_tokens_per_gpu / layout.cp
    if is_last:  # logprob head: bf16 logits + bf16 logit grads of a chunk, final hidden and its grad
        chunk = min(work.logprob_chunk_tokens, seq)
        buffers += chunk * costs.vocab_size / layout.tp * (2 + 2) + 2 * 2 * seq * costs.hidden_size
    if layout.tp > 1:  # sequence-parallel all-gather of a layer input
        buffers += 2 * 2 * seq * costs.hidden_size
    if layout.ep > 1 and any(c.is_moe for c, _ in present):  # all-to-all send and receive
        buffers += 2 * 2 * t * costs.top_k * costs.hidden_size
    if layout.pp > 1:  # p2p activation and gradient buffers
        buffers += 2 * 2 * t * costs.hidden_size
    buffers += NCCL_BUFFERS_GB * GB if layout.world > 1 else 0.0
    bd = Breakdown(params / GB, grads / GB, optimizer / GB, activations / GB, buffers / GB)
    return bd, per_gpu


def rollout_memory(costs: ModelCosts, hw: Hardware, work: Workload) -> RolloutMemory | None:
    """Weights and KV cache per GPU of the colocated rollout (None when there is no rollout)."""
    if not work.colocated_rollout:
        return None
    weights = 2 * costs.total_params
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
    results = [_stage_memory(costs, r, s, layout, work) for s, r in enumerate(stages)]
    rollout = rollout_memory(costs, hw, work)
    # what the rollout keeps on the GPU while training: its weights (params), its KV cache (buffers)
    weights_kept = rollout.weights_gb if rollout and work.rollout_weights_on_gpu else 0.0
    kv_kept = rollout.kv_cache_gb if rollout and work.rollout_kv_on_gpu else 0.0
    peaks = [bd.total + weights_kept + kv_kept for bd, _ in results]
    worst = max(range(len(peaks)), key=peaks.__getitem__)
    breakdown = results[worst][0]
    breakdown = replace(
        breakdown, params=breakdown.params + weights_kept, buffers=breakdown.buffers + kv_kept
    )
    # Host per GPU: offloaded fp32 master + moments + pinned fp32 gradient staging; while the
    # rollout runs, the training engine's GPU state (fp32 shards and moments) waits on the host;
    # while training runs, the rollout's weights do (unless they stay on the GPU).
    per_gpu = max(p for _, p in results)
    offloaded = 16 * layout.offload_fraction * per_gpu
    during_rollout = (4 + 8 * (1 - layout.offload_fraction)) * per_gpu if rollout else 0.0
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
    )


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
