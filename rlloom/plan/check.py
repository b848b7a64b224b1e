"""`check_fits(cfg)`: the trainer's start-up check that the run's layout fits the GPU it got.

The layout is the run's own: `parallel.tp/pp/cp/ep` and its uneven pipeline split, data parallelism
what `cluster.num_workers` leaves, optimizer offload from train.optimizer_offload(_fraction), LoRA's
adapters (train.lora_rank) as the only trained parameters, PPO's critic, on-policy distillation's
teacher (teacher.path; on the host between its forwards with teacher.offload) and the reward model
(reward.model_path, whole on the trainer's device: the first GPU, or the host). With
cluster.placement=colocated the rollout shares the training GPUs: it keeps a full bf16 weight copy
(sharded over rollout.tp; its routed experts in fp8 with rollout.quantization=fp8) while training,
and its KV cache (rollout.kv_cache_memory_gb) too unless rollout.sleep_during_train. With
rollout.num_blocks set, the cache is sized as the planner's default. With placement=separate the
training GPUs hold no rollout.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

import torch

from rlloom.config import ConfigError, RunConfig
from rlloom.devices import available_memory_bytes
from rlloom.models.args import ModelArgs
from rlloom.models.checkpoint import resolve_path
from rlloom.plan.counts import lora_params, model_costs, value_model_params
from rlloom.plan.inputs import Hardware, Layout, Workload
from rlloom.plan.memory import GB, Estimate, estimate

_RECOMPUTE = {"off": "none", "full": "full", "every_k": "full"}


def run_layout(
    cfg: RunConfig, models: ModelParams | None = None, *, on_cuda: bool = True
) -> tuple[Layout, Workload]:
    """The layout and workload a run with `cfg` trains with (`models`: the parameter counts of its
    models besides the policy, none by default; `on_cuda`: False for a CPU run, which computes eagerly
    and, with model.dtype=auto, in fp32)."""
    models = models or ModelParams()
    par, train = cfg.parallel, cfg.train
    fp32 = cfg.model.dtype == "float32" or (cfg.model.dtype == "auto" and not on_cuda)
    offload = train.optimizer_offload_fraction if train.optimizer_offload else 0.0
    every_k = train.ac_every_k if train.activation_checkpointing == "every_k" else 1
    colocated = cfg.cluster.placement == "colocated"
    work = Workload(
        max_tokens_per_gpu=train.max_tokens_per_micro_batch,
        recompute=_RECOMPUTE[train.activation_checkpointing],
        recompute_every_k=every_k,
        logprob_chunk_tokens=train.logprob_chunk_tokens,
        compiled=train.compile and on_cuda,
        compute_bytes=4 if fp32 else 2,
        colocated_rollout=colocated,
        rollout_weights_on_gpu=True,
        rollout_model_parallel=cfg.rollout.tp,
        rollout_kv_cache_gb=cfg.rollout.kv_cache_memory_gb if cfg.rollout.num_blocks == 0 else 0.0,
        rollout_kv_on_gpu=not cfg.rollout.sleep_during_train,
        rollout_quantization=cfg.rollout.quantization,
        lora_params=models.lora,
        critic_params=models.critic,
        teacher_params=models.teacher,
        teacher_offload=cfg.teacher.offload,
        reward_model_params=models.reward_model,
    )
    layout = Layout(
        tp=par.tp,
        pp=par.pp,
        cp=par.cp,
        ep=par.ep,
        dp=cfg.cluster.num_workers // (par.tp * par.pp * par.cp),
        offload_fraction=offload,
        pp_first_stage_layers=par.pp_first_stage_layers,
        pp_last_stage_layers=par.pp_last_stage_layers,
    )
    return layout, work


@dataclass(frozen=True, slots=True)
class ModelParams:
    """Parameter counts of a run's models besides the policy; 0 where the run has none."""

    critic: float = 0.0
    """PPO's critic (algorithm.estimator=gae)."""
    lora: float = 0.0
    """The LoRA adapters (train.lora_rank); 0 for full fine-tuning."""
    teacher: float = 0.0
    """On-policy distillation's teacher (teacher.path)."""
    reward_model: float = 0.0
    """The reward model (reward.model_path)."""


def run_models(cfg: RunConfig) -> ModelParams:
    """The parameter counts of `cfg`'s critic, LoRA adapters, teacher and reward model, from their
    config.json files. A reward model whose family rlloom's models do not cover (transformers runs
    any) is not counted."""
    args = _args(cfg.model.path)
    critic = value_model_params(model_costs(_args(cfg.critic_model_path))) if cfg.algorithm.uses_critic else 0
    adapters = (
        lora_params(args, cfg.train.lora_rank, cfg.train.lora_target_modules) if cfg.train.lora_rank else 0
    )
    teacher = model_costs(_args(cfg.teacher.path)).total_params if cfg.uses_teacher else 0
    reward = 0
    if cfg.reward.model_path:
        try:  # the body and a one-label score head: the critic's shape
            reward = value_model_params(model_costs(_args(cfg.reward.model_path)))
        except (ValueError, KeyError, TypeError):
            reward = 0
    return ModelParams(critic, adapters, teacher, reward)


def run_estimate(
    cfg: RunConfig,
    memory_gb: float,
    cpu_memory_gb: float = 0.0,
    *,
    on_cuda: bool = True,
    tokens: int = 0,
    models: ModelParams | None = None,
) -> Estimate:
    """The memory model's estimate of `cfg`'s layout on devices of `memory_gb` (`tokens`: a
    micro-batch's tokens instead of the run's; `models`: other counts than the run's own)."""
    costs = model_costs(_args(cfg.model.path))
    layout, work = run_layout(cfg, models or run_models(cfg), on_cuda=on_cuda)
    if tokens:
        work = replace(work, max_tokens_per_gpu=tokens)
    hw = Hardware(
        gpus=layout.world,
        gpu_memory_gb=memory_gb,
        gpus_per_node=layout.world,
        cpu_memory_gb_per_node=cpu_memory_gb,
    )
    return estimate(costs, layout, hw, work)


def fit_warning(cfg: RunConfig, gpu_memory_gb: float, cpu_memory_gb: float = 0.0) -> str | None:
    """A one-line warning when the memory model says `cfg` will not fit GPUs of `gpu_memory_gb`."""
    est = run_estimate(cfg, gpu_memory_gb, cpu_memory_gb)
    if est.fits:
        return None
    return (
        f"the memory model predicts this run will not fit ({est.layout.short()}): {'; '.join(est.problems)}. "
        "Fix: lower train.max_tokens_per_micro_batch, set train.activation_checkpointing=full or "
        "train.optimizer_offload=true, or see `rlloom plan` (docs/plan.md)."
    )


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """The memory one training rank of the run may take."""

    per_rank_gb: float
    where: str
    """What that is, for the error: "a GPU has 79.1 GiB" or "this host has 23.0 GiB available
    shared by 2 ranks"."""
    on_cuda: bool

    @property
    def limit_gb(self) -> float:
        """The predicted peak above which a run is refused: the GPU's memory, or on CPU the rank's
        share of the host's available memory times CPU_OVERESTIMATE."""
        return self.per_rank_gb * (1.0 if self.on_cuda else CPU_OVERESTIMATE)


CPU_OVERESTIMATE = 1.5
"""How far the memory model over-predicts a CPU run: it counts bf16 parameter copies and GPU buffers,
and eager activations by a factor measured in bf16 on a GPU. The demo (arithmetic_demo, one step,
2048-token micro-batches) peaked at 4.7 GiB resident against 7.5 GiB predicted (2026-11-29); a
refusal must be sure, so a CPU run is refused only beyond this factor of its share."""


def memory_problem(cfg: RunConfig, memory: DeviceMemory) -> str | None:
    """One line when the memory model's peak of a training rank (model states, one micro-batch's
    activations and logits, the colocated rollout's weights) exceeds `memory`, naming the setting to
    change; None when it fits."""
    tokens = micro_batch_tokens(cfg)  # what a micro-batch can hold, not the budget (a refusal is sure)
    need = run_estimate(cfg, memory.per_rank_gb, on_cuda=memory.on_cuda, tokens=tokens)
    if need.gpu_memory_gb <= memory.limit_gb:
        return None
    if frozen := _frozen_model_problem(cfg, memory, tokens, need):
        return frozen
    # what the rank holds besides the micro-batch: the peak of a one-token micro-batch
    states = run_estimate(cfg, memory.per_rank_gb, on_cuda=memory.on_cuda, tokens=1).gpu_memory_gb
    fitting = _largest_fitting_tokens(cfg, memory, tokens)
    layout, longest = need.layout.short(), cfg.longest_sequence
    if fitting >= longest:
        return (
            f"train.max_tokens_per_micro_batch={cfg.train.max_tokens_per_micro_batch} is too large here: "
            f"a training rank ({layout}) needs about {need.gpu_memory_gb:.1f} GiB with a micro-batch of "
            f"{tokens} tokens ({need.gpu_memory_gb - states:.1f} GiB of it the micro-batch's activations and "
            f"logits), and {memory.where}. Fix: lower train.max_tokens_per_micro_batch to {fitting} or "
            "less, or split a micro-batch over more ranks (raise parallel.tp or parallel.cp)."
        )
    return (
        f"cluster.num_workers={cfg.cluster.num_workers} is too few here: a training rank ({layout}) needs "
        f"more than {memory.limit_gb:.1f} GiB even with a micro-batch of one {longest}-token sequence "
        f"({states:.1f} GiB for the model states, optimizer and rollout weights alone), and {memory.where}. "
        "Fix: shard the model over more ranks (raise cluster.num_workers, with parallel.tp or parallel.pp), "
        "set train.optimizer_offload=true or train.lora_rank, or shorten the sequences "
        "(data.max_prompt_length, rollout.max_new_tokens); `rlloom plan` lists layouts that fit "
        "(docs/plan.md)."
    )


def _frozen_model_problem(cfg: RunConfig, memory: DeviceMemory, tokens: int, need: Estimate) -> str | None:
    """The line naming the teacher or the reward model when the run would fit without it (the
    forward-only model the user added is what to change), with teacher.offload=true as the fix on a
    GPU where that fits; None when neither is why."""
    models, where = run_models(cfg), f"a training rank ({need.layout.short()})"
    for setting, path, without_it in (
        ("teacher.path", cfg.teacher.path, replace(models, teacher=0.0)),
        ("reward.model_path", cfg.reward.model_path, replace(models, reward_model=0.0)),
    ):
        if without_it == models:
            continue
        alone = run_estimate(
            cfg, memory.per_rank_gb, on_cuda=memory.on_cuda, tokens=tokens, models=without_it
        )
        if alone.gpu_memory_gb > memory.limit_gb:
            continue
        head = (
            f"{setting}={path!r} does not fit beside the policy here: {where} needs about "
            f"{need.gpu_memory_gb:.1f} GiB with it and {alone.gpu_memory_gb:.1f} GiB without, and {memory.where}."
        )
        if setting == "reward.model_path":  # whole, on the trainer's device beside the first rank
            return f"{head} Fix: use a smaller reward model, or lower train.max_tokens_per_micro_batch."
        if memory.on_cuda and not cfg.teacher.offload:
            offloaded = replace(cfg, teacher=replace(cfg.teacher, offload=True))
            off = run_estimate(offloaded, memory.per_rank_gb, tokens=tokens).gpu_memory_gb
            if off <= memory.limit_gb:
                return (
                    f"{head} Fix: set teacher.offload=true (its weights wait on the host between its "
                    f"forwards; about {off:.1f} GiB then), or shard both models over more ranks."
                )
        return (
            f"{head} Fix: shard both models over more ranks (raise cluster.num_workers, with parallel.tp or "
            "parallel.pp), or use a smaller teacher."
        )
    return None


def micro_batch_tokens(cfg: RunConfig) -> int:
    """Most tokens one micro-batch holds: the budget (pipeline stages pad every micro-batch to it),
    no more than a whole step's sequences, and at least one sequence (a longer one goes alone, never
    cut)."""
    budget, longest = cfg.train.max_tokens_per_micro_batch, cfg.longest_sequence
    if cfg.parallel.pp > 1:
        return budget
    step = cfg.trainer.prompts_per_step * cfg.rollout.n_samples * longest
    return max(longest, min(budget, step))


def _largest_fitting_tokens(cfg: RunConfig, memory: DeviceMemory, tokens: int) -> int:
    """The largest micro-batch below `tokens` whose estimate fits `memory` (0 if none), by bisection
    (the peak grows with the tokens)."""
    limit_gb = memory.limit_gb
    low, high = 0, tokens  # low fits (or is 0), high does not
    while high - low > max(1, low // 100):  # to 1%: the fix names a round enough number
        mid = (low + high) // 2
        if run_estimate(cfg, limit_gb, on_cuda=memory.on_cuda, tokens=mid).gpu_memory_gb <= limit_gb:
            low = mid
        else:
            high = mid
    return low - low % 1024 if low >= 2048 else low  # a round number


def _args(path: str) -> ModelArgs:
    return ModelArgs.from_hf_config(json.loads((resolve_path(path) / "config.json").read_text()))


def device_memory_gb(cfg: RunConfig) -> tuple[float, float] | None:
    """(GPU memory, host memory) in GB of this machine, or None when the run does not use CUDA."""
    if cfg.cluster.device == "cpu" or not torch.cuda.is_available():
        return None
    gpu = torch.cuda.get_device_properties(0).total_memory / GB
    return gpu, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB


def rank_memory(cfg: RunConfig) -> DeviceMemory:
    """What one training rank may take: a whole GPU, or on CPU the host's available memory shared by
    every rank of the run (Ray's actors run on this host; separate rollout slots take a share too)."""
    memory = device_memory_gb(cfg)
    if memory is not None:
        return DeviceMemory(memory[0], f"a GPU has {memory[0]:.1f} GiB", on_cuda=True)
    ranks = cfg.cluster.num_workers + (
        cfg.cluster.rollout_workers if cfg.cluster.placement == "separate" else 0
    )
    available = available_memory_bytes(torch.device("cpu")) / GB
    shared = f" shared by {ranks} ranks" if ranks > 1 else ""
    return DeviceMemory(
        available / ranks, f"this host has {available:.1f} GiB available{shared}", on_cuda=False
    )


def check_memory(cfg: RunConfig) -> None:
    """Refuse at start-up, in one line, a layout whose training peak exceeds the device's memory
    (on CUDA the GPU's, on CPU the available host memory), instead of an out-of-memory crash later."""
    problem = memory_problem(cfg, rank_memory(cfg))
    if problem is not None:
        raise ConfigError(problem)


def check_fits(cfg: RunConfig) -> str | None:
    """`fit_warning` for this machine's GPU and host memory; None off CUDA (nothing to check)."""
    memory = device_memory_gb(cfg)
    return None if memory is None else fit_warning(cfg, *memory)
