"""The `train` section: the training engine's optimizer, micro-batches, memory options, MoE and LoRA."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from rlloom.config.checks import check, check_finite

LORA_TARGET_NAMES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "q_a_proj",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_b_proj",
)
"""Hugging Face projection names `train.lora_target_modules` may list (rlloom/models/lora.py)."""


def lora_targets_valid(targets: str) -> bool:
    """`all-linear`, or a non-empty comma list of LORA_TARGET_NAMES: the rule of
    train.lora_target_modules (and of `rlloom plan --lora-target-modules`)."""
    names = [t.strip() for t in targets.split(",") if t.strip()]
    return targets.strip() == "all-linear" or (bool(names) and all(t in LORA_TARGET_NAMES for t in names))


def shares_prompts(setting: bool | None, cp: int) -> bool:
    """train.share_prompts resolved for a layout of `cp` context-parallel ranks: null shares the
    prompts unless CP splits the documents, which it does only for plain packing."""
    return cp == 1 if setting is None else setting


@dataclass(kw_only=True, slots=True)
class TrainEngineConfig:
    lr: float = 1e-5
    """Peak learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Schedule after warmup: constant, linear decay to 0, or cosine decay to min_lr_ratio * lr."""
    warmup_steps: int = 0
    """Linear warmup optimizer steps."""
    min_lr_ratio: float = 0.0
    """Cosine floor as a fraction of lr."""
    grad_clip: float = 1.0
    """Clip gradients by global norm (0 = off)."""
    max_tokens_per_micro_batch: int = 4096
    """Token budget per micro-batch (max_tokens_per_gpu of verl and slime)."""
    gather_once_per_step: bool = False
    """FSDP: gather the compute-dtype parameters once per optimizer step and reduce the gradients
    once, after the last micro-batch (accumulating them unsharded in fp32), instead of around every
    micro-batch. Saves per-micro-batch copies, casts and collectives; costs a full compute-dtype
    copy of the parameters plus a full fp32 gradient on every rank for the whole step. Worth it for
    models that fit on one GPU several times over (e.g. 0.6B-4B), not for sharding large ones. One
    GPU without optimizer offload runs without FSDP and already works this way
    (rlloom/parallel/mixed_precision.py)."""
    activation_checkpointing: Literal["off", "full", "every_k"] = "off"
    """Recompute activations in backward for all layers, or every k-th layer."""
    ac_every_k: int = 2
    """With activation_checkpointing=every_k: checkpoint every k-th layer."""
    compile: bool = True
    """torch.compile each decoder layer on CUDA (fuses norms, RoPE and SwiGLU: 1.37x faster train step
    on an H200; the first steps pay the compile time). CPU runs stay eager: compiling takes minutes."""
    optimizer_offload: bool = False
    """Run the AdamW step on CPU with its state in CPU memory (CPU Adam). On one GPU it also keeps
    FSDP's bf16 copies one layer at a time (2 bytes a parameter less at the peak, a slower step)."""
    optimizer_offload_fraction: float = 1.0
    """Fraction of parameters whose optimizer state is offloaded when optimizer_offload is on."""
    logprob_chunk_tokens: int = 4096
    """Tokens per chunk of the logprob head (bounds the logits memory: chunk x vocabulary)."""
    share_prompts: bool | None = None
    """Pack a group's responses behind one copy of their shared prompt; exact, fewer FLOPs. null (the
    default): on, unless parallel.cp > 1 (context parallelism splits plain packed documents only)."""
    moe_aux_loss_coef: float = 0.0
    """MoE load-balancing auxiliary loss coefficient (Qwen3-MoE/Mixtral's router_aux_loss_coef, e.g.
    0.001 in pre-training). 0, as verl, slime and NeMo-RL run RL: the loss would pull the router away
    from the rollout's routing. See rlloom/models/moe.py."""
    moe_bias_update_rate: float = 0.0
    """DeepSeek-V3 correction-bias update per step (its pre-training used 0.001): under-loaded experts'
    bias rises by this much, over-loaded ones' falls. 0 keeps the checkpoint's bias, as RL runs do."""
    freeze_vision: bool = False
    """A vision-language model (Qwen2.5-VL): keep the vision tower (patch embedding, blocks, merger) as
    loaded: no gradient, no optimizer state. Off, as verl's freeze_vision_tower and TRL's trainers
    default: the whole model trains unless asked otherwise. No effect on a text-only model."""
    lora_rank: int = 0
    """LoRA: train rank-r adapters on the targeted projections with the rest of the policy frozen
    (0 = full fine-tuning). Gradients and AdamW state exist for the adapters only; the weight sync,
    `rlloom export` and the run's Hugging Face folders carry the merged weights, so the rollout
    engine runs the plain model. LoRA usually wants a larger train.lr than full fine-tuning (e.g.
    10x). The reference and the critic stay full models. Runs in every layout (FSDP, parallel.tp,
    pp, cp, ep; routed experts stay frozen)."""
    lora_alpha: float = 16.0
    """LoRA's scale numerator: the update is (lora_alpha / lora_rank) x B A."""
    lora_target_modules: str = "all-linear"
    """The projections that get adapters: all-linear (every attention and dense-MLP projection of the
    decoder layers; routed experts, routers, embeddings and the lm head stay frozen) or a comma list
    of Hugging Face names: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, q_a_proj,
    q_b_proj, kv_a_proj_with_mqa, kv_b_proj."""

    def __post_init__(self) -> None:
        check_finite(self, "train")
        check(
            self.lora_rank >= 0, "train.lora_rank", self.lora_rank, "must be >= 0", "use 0 (off) or e.g. 16"
        )
        check(self.lora_alpha > 0, "train.lora_alpha", self.lora_alpha, "must be > 0", "e.g. 32")
        check(
            lora_targets_valid(self.lora_target_modules),
            "train.lora_target_modules",
            self.lora_target_modules,
            f"must be all-linear or a comma list of {', '.join(LORA_TARGET_NAMES)}",
            "use all-linear, or e.g. q_proj,v_proj",
        )
        check(self.lr > 0, "train.lr", self.lr, "must be > 0", "e.g. 1e-5")
        check(
            self.weight_decay >= 0, "train.weight_decay", self.weight_decay, "must be >= 0", "use 0.0 or 0.01"
        )
        check(
            all(0 <= b < 1 for b in self.betas),
            "train.betas",
            self.betas,
            "each must be in [0, 1)",
            "use [0.9, 0.999]",
        )
        check(self.adam_eps > 0, "train.adam_eps", self.adam_eps, "must be > 0", "use 1e-8")
        check(self.warmup_steps >= 0, "train.warmup_steps", self.warmup_steps, "must be >= 0", "use 0")
        check(
            0 <= self.min_lr_ratio <= 1,
            "train.min_lr_ratio",
            self.min_lr_ratio,
            "must be in [0, 1]",
            "use 0.0",
        )
        check(
            self.grad_clip >= 0, "train.grad_clip", self.grad_clip, "must be >= 0", "use 1.0 or 0 to disable"
        )
        check(
            self.max_tokens_per_micro_batch >= 1,
            "train.max_tokens_per_micro_batch",
            self.max_tokens_per_micro_batch,
            "must be >= 1",
            "e.g. 4096",
        )
        check(self.ac_every_k >= 1, "train.ac_every_k", self.ac_every_k, "must be >= 1", "use 2")
        check(
            0 < self.optimizer_offload_fraction <= 1,
            "train.optimizer_offload_fraction",
            self.optimizer_offload_fraction,
            "must be in (0, 1]",
            "use 1.0",
        )
        check(
            self.logprob_chunk_tokens >= 1,
            "train.logprob_chunk_tokens",
            self.logprob_chunk_tokens,
            "must be >= 1",
            "use 1024",
        )
        for name in ("moe_aux_loss_coef", "moe_bias_update_rate"):
            value = getattr(self, name)
            check(
                math.isfinite(value) and value >= 0,
                f"train.{name}",
                value,
                "must be a finite number >= 0",
                "use 0 (off, as RL runs do) or e.g. 0.001",
            )
