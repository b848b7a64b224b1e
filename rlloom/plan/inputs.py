"""The memory model's inputs: a training layout, the hardware and the workload (memory.py estimates
from them; phases.py computes one stage's terms)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Recompute = Literal["full", "selective", "none"]
RESERVED_GB = 2.0
"""Per-GPU memory that is not the allocator's: CUDA context, NCCL, cuBLAS workspaces."""
FRAGMENTATION = 0.05
"""Fraction of the rest lost to allocator fragmentation."""
HOST_OVERHEAD_GB_PER_GPU = 24.0
"""Host memory of one GPU's worker process besides model state (Python, torch, CUDA host side,
rollout engine, data)."""
ROLLOUT_WEIGHTS_FRACTION = 0.5
"""The rollout shards its weights over the fewest GPUs (a power of two) that keep them under this
fraction of a GPU, as verl does (tensor parallel 32 for DeepSeek-V3 on 96 GB)."""
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
    image_patches_per_gpu: int = 0
    """Patches of the pictures in one micro-batch of one GPU (a vision-language model): the vision
    tower runs them on the first pipeline stage, whole (data parallel only), nothing recomputed."""
    recompute_every_k: int = 1
    """With full recompute: checkpoint every k-th layer (rlloom's activation_checkpointing=every_k)."""
    logprob_chunk_tokens: int = 4096
    response_fraction: float = 1.0
    """Fraction of a micro-batch's tokens whose logprob the head computes (the response tokens);
    1.0 bounds it."""
    micro_batches: int = 2
    """Micro-batches per optimizer step on a GPU. From the second one on, each backward runs beside
    the fp32 gradients the earlier ones accumulated (so 2 and more peak alike); 1 is a step of one."""
    compiled: bool = True
    """Decoder layers run torch.compile'd (rlloom's default on CUDA); eager ones save more."""
    compute_bytes: int = 2
    """Bytes of one activation or logit element: 2 for bf16 (rlloom's compute dtype on CUDA), 4 for
    fp32 (its default on CPU). Parameter copies are counted in bf16 either way."""
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
    rollout_quantization: str = "none"
    """rlloom's rollout.quantization: `fp8` holds the routed experts in 1 byte a parameter plus an
    fp32 scale per 128 (the rest stays bf16)."""
    lora_params: float = 0.0
    """Trainable LoRA adapter parameters (train.lora_rank > 0; plan/counts.lora_params): only they
    get gradients and AdamW moments, and on one device the frozen base is kept in bf16; 0: full
    fine-tuning."""
    critic_params: float = 0.0
    """Parameters of PPO's critic (algorithm.estimator=gae), a second model trained on the same GPUs
    in the same layout; 0: no critic."""
    teacher_params: float = 0.0
    """Parameters of on-policy distillation's teacher (teacher.path): forward-only on the training
    GPUs in their layout, in the compute dtype (no master copy, gradients or moments); 0: no teacher."""
    teacher_offload: bool = False
    """teacher.offload: the teacher's weights wait on the host and visit the GPUs for its forward,
    when the policy holds its states alone (no gradients, no activations)."""
    reward_model_params: float = 0.0
    """Parameters of the reward model (reward.model_path): forward-only in the trainer's process, on
    its device (the first GPU; on CPU the host), in the compute dtype; 0: no reward model."""
