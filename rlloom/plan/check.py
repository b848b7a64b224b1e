"""`check_fits(cfg)`: the trainer's start-up check that the run's layout fits the GPU it got.

The layout is the run's own: `parallel.tp/pp/cp/ep` and its uneven pipeline split, data parallelism
what `cluster.num_workers` leaves, optimizer offload from train.optimizer_offload(_fraction), LoRA's
adapters (train.lora_rank) as the only trained parameters, and PPO's critic. With
cluster.placement=colocated the rollout shares the training GPUs: it keeps a full bf16 weight copy
(sharded over rollout.tp; its routed experts in fp8 with rollout.quantization=fp8) while training,
and its KV cache (rollout.kv_cache_memory_gb) too unless rollout.sleep_during_train. With
rollout.num_blocks set, the cache is sized as the planner's default. With placement=separate the
training GPUs hold no rollout.
"""

from __future__ import annotations

import json
import os

import torch

from rlloom.config import RunConfig
from rlloom.models.args import ModelArgs
from rlloom.models.checkpoint import resolve_path
from rlloom.plan.counts import lora_params, model_costs, value_model_params
from rlloom.plan.inputs import Hardware, Layout, Workload
from rlloom.plan.memory import GB, estimate

_RECOMPUTE = {"off": "none", "full": "full", "every_k": "full"}


def run_layout(
    cfg: RunConfig, critic_params: float = 0.0, lora_params: float = 0.0
) -> tuple[Layout, Workload]:
    """The layout and workload a run with `cfg` trains with (`critic_params`: PPO's critic's
    parameter count, 0 without one; `lora_params`: the LoRA adapters', 0 for full fine-tuning)."""
    par, train = cfg.parallel, cfg.train
    offload = train.optimizer_offload_fraction if train.optimizer_offload else 0.0
    every_k = train.ac_every_k if train.activation_checkpointing == "every_k" else 1
    colocated = cfg.cluster.placement == "colocated"
    work = Workload(
        max_tokens_per_gpu=train.max_tokens_per_micro_batch,
        recompute=_RECOMPUTE[train.activation_checkpointing],
        recompute_every_k=every_k,
        logprob_chunk_tokens=train.logprob_chunk_tokens,
        compiled=train.compile,
        colocated_rollout=colocated,
        rollout_weights_on_gpu=True,
        rollout_model_parallel=cfg.rollout.tp,
        rollout_kv_cache_gb=cfg.rollout.kv_cache_memory_gb if cfg.rollout.num_blocks == 0 else 0.0,
        rollout_kv_on_gpu=not cfg.rollout.sleep_during_train,
        rollout_quantization=cfg.rollout.quantization,
        lora_params=lora_params,
        critic_params=critic_params,
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


def fit_warning(cfg: RunConfig, gpu_memory_gb: float, cpu_memory_gb: float = 0.0) -> str | None:
    """A one-line warning when the memory model says `cfg` will not fit GPUs of `gpu_memory_gb`."""
    args = _args(cfg.model.path)
    costs = model_costs(args)
    critic = 0.0
    if cfg.algorithm.uses_critic:
        critic = value_model_params(model_costs(_args(cfg.critic_model_path)))
    adapters = 0.0
    if cfg.train.lora_rank:
        adapters = lora_params(args, cfg.train.lora_rank, cfg.train.lora_target_modules)
    layout, work = run_layout(cfg, critic, adapters)
    hw = Hardware(
        gpus=layout.world,
        gpu_memory_gb=gpu_memory_gb,
        gpus_per_node=layout.world,
        cpu_memory_gb_per_node=cpu_memory_gb,
    )
    est = estimate(costs, layout, hw, work)
    if est.fits:
        return None
    return (
        f"the memory model predicts this run will not fit ({layout.short()}): {'; '.join(est.problems)}. "
        "Fix: lower train.max_tokens_per_micro_batch, set train.activation_checkpointing=full or "
        "train.optimizer_offload=true, or see `rlloom plan` (docs/plan.md)."
    )


def _args(path: str) -> ModelArgs:
    return ModelArgs.from_hf_config(json.loads((resolve_path(path) / "config.json").read_text()))


def device_memory_gb(cfg: RunConfig) -> tuple[float, float] | None:
    """(GPU memory, host memory) in GB of this machine, or None when the run does not use CUDA."""
    if cfg.cluster.device == "cpu" or not torch.cuda.is_available():
        return None
    gpu = torch.cuda.get_device_properties(0).total_memory / GB
    return gpu, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB


def check_fits(cfg: RunConfig) -> str | None:
    """`fit_warning` for this machine's GPU and host memory; None off CUDA (nothing to check)."""
    memory = device_memory_gb(cfg)
    return None if memory is None else fit_warning(cfg, *memory)
