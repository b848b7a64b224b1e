"""`check_fits(cfg)`: the trainer's start-up check that the run's layout fits the GPU it got.

Today's layout is one GPU per worker: tp = pp = cp = ep = 1, dp = cluster.num_workers, optimizer
offload from train.optimizer_offload(_fraction), and the colocated rollout keeps a full bf16 weight
copy on the GPU while training (its routed experts in fp8 with rollout.quantization=fp8), and its KV cache (rollout.kv_cache_memory_gb) too unless
rollout.sleep_during_train. With rollout.num_blocks set, the cache is sized as the planner's default. Once a `parallel` config section exists, its
degrees replace the ones fixed here.
"""

from __future__ import annotations

import json
import os

import torch

from rlloom.config.components import RunConfig
from rlloom.models.args import ModelArgs
from rlloom.models.checkpoint import resolve_path
from rlloom.plan.counts import ModelCosts, model_costs, value_model_params
from rlloom.plan.inputs import Hardware, Layout, Workload
from rlloom.plan.memory import GB, estimate

_RECOMPUTE = {"off": "none", "full": "full", "every_k": "full"}


def run_layout(cfg: RunConfig, critic_params: float = 0.0) -> tuple[Layout, Workload]:
    """The layout and workload a run with `cfg` trains with today (`critic_params`: PPO's critic's
    parameter count, 0 without one)."""
    offload = cfg.train.optimizer_offload_fraction if cfg.train.optimizer_offload else 0.0
    every_k = cfg.train.ac_every_k if cfg.train.activation_checkpointing == "every_k" else 1
    work = Workload(
        max_tokens_per_gpu=cfg.train.max_tokens_per_micro_batch,
        recompute=_RECOMPUTE[cfg.train.activation_checkpointing],
        recompute_every_k=every_k,
        logprob_chunk_tokens=cfg.train.logprob_chunk_tokens,
        compiled=cfg.train.compile,
        colocated_rollout=True,
        rollout_weights_on_gpu=True,
        rollout_model_parallel=1,
        rollout_kv_cache_gb=cfg.rollout.kv_cache_memory_gb if cfg.rollout.num_blocks == 0 else 0.0,
        rollout_kv_on_gpu=not cfg.rollout.sleep_during_train,
        rollout_quantization=cfg.rollout.quantization,
        critic_params=critic_params,
    )
    return Layout(dp=cfg.cluster.num_workers, offload_fraction=offload), work


def fit_warning(cfg: RunConfig, gpu_memory_gb: float, cpu_memory_gb: float = 0.0) -> str | None:
    """A one-line warning when the memory model says `cfg` will not fit GPUs of `gpu_memory_gb`."""
    costs = _costs(cfg.model.path)
    critic = 0.0
    if cfg.algorithm.uses_critic:
        critic = value_model_params(_costs(cfg.critic_model_path))
    layout, work = run_layout(cfg, critic)
    hw = Hardware(
        gpus=layout.dp,
        gpu_memory_gb=gpu_memory_gb,
        gpus_per_node=layout.dp,
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


def _costs(path: str) -> ModelCosts:
    return model_costs(ModelArgs.from_hf_config(json.loads((resolve_path(path) / "config.json").read_text())))


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
