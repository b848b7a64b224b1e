"""`build_train_engine`, `build_reference` and `build_critic`: the training backend a run asks for, picked with a
plain `if` (one backend, `native`, today). Workers build their engines only through these; the
parallel layout (`ParallelDims`) comes from the `parallel` config section and the world size
(cluster.num_workers)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from rlloom.config import RunConfig, TrainEngineConfig
from rlloom.engines.train.base import TrainEngine
from rlloom.models.adapter import CheckpointMismatch
from rlloom.parallel.dims import ParallelDims


def _optimizer_steps(cfg: RunConfig) -> int:
    t = cfg.trainer
    return t.total_steps * t.ppo_epochs * t.num_mini_batches


def parallel_dims(cfg: RunConfig) -> ParallelDims | None:
    """The run's layout: None for one process without any parallel degree (an unsharded engine)."""
    par, world = cfg.parallel, cfg.cluster.num_workers
    if world == 1 and par.tp == par.pp == par.cp == par.ep == 1:
        return None
    return ParallelDims(world_size=world, tp=par.tp, pp=par.pp, cp=par.cp, ep=par.ep)


def _native(
    cfg: RunConfig,
    engine_cfg: TrainEngineConfig,
    model_path: str,
    *,
    device: torch.device,
    dtype: torch.dtype,
    **kind: Any,
) -> TrainEngine:
    """The native engine over `model_path` in the run's parallel layout and schedule length; `kind`:
    `frozen` (the reference) or `head` (the critic). A checkpoint whose tensors do not fit its
    config.json is reported under the setting that named it."""
    from rlloom.engines.train.native import NativeTrainEngine

    try:
        return NativeTrainEngine.build(
            engine_cfg,
            model_path,
            device=device,
            dtype=dtype,
            total_steps=_optimizer_steps(cfg),
            parallel_dims=parallel_dims(cfg),
            pipeline=cfg.parallel,
            **kind,
        )
    except CheckpointMismatch as e:
        key = "critic.model_path" if kind.get("head") == "value" and cfg.critic.model_path else "model.path"
        raise CheckpointMismatch(f"{key}={model_path!r} is invalid: {e}") from None


def build_train_engine(cfg: RunConfig, *, device: torch.device, dtype: torch.dtype) -> TrainEngine:
    """This rank's training engine: the policy with its optimizer, in the run's parallel layout."""
    return _native(cfg, cfg.train, cfg.model.path, device=device, dtype=dtype)


def build_reference(cfg: RunConfig, *, device: torch.device, dtype: torch.dtype) -> TrainEngine:
    """The frozen reference policy (the initial weights) for the KL loss: forward-only, in the
    compute dtype and the run's layout, with no fp32 master copy, no gradients and no optimizer
    (only `forward_logprobs` is ever called on it)."""
    return _native(cfg, cfg.train, cfg.model.path, device=device, dtype=dtype, frozen=True)


def build_critic(cfg: RunConfig, *, device: torch.device, dtype: torch.dtype) -> TrainEngine:
    """The critic of PPO (algorithm.estimator=gae): a value model (`ValueHead`) with its own optimizer,
    started from `critic.model_path` (or the policy's checkpoint) in the run's layout; the `train`
    section's settings with the critic's learning rate and clipping."""
    return _native(
        cfg, critic_engine_config(cfg), cfg.critic_model_path, device=device, dtype=dtype, head="value"
    )


def critic_engine_config(cfg: RunConfig) -> TrainEngineConfig:
    """The critic's engine settings: the `train` section's with the critic's learning rate and clipping
    (a full model: LoRA adapts the policy only)."""
    return dataclasses.replace(cfg.train, lr=cfg.critic.lr, grad_clip=cfg.critic.grad_clip, lora_rank=0)
