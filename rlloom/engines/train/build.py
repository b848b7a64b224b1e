"""`build_train_engine`, `build_reference`, `build_teacher` and `build_critic`: the training backend a run asks for, picked with a
plain `if` (one backend, `native`, today). Workers build their engines only through these; the
parallel layout (`ParallelDims`) comes from the `parallel` config section and the world size
(cluster.num_workers). The controller reaches the backend only through here: the start-up check of
the parallel degrees against the model (`check_parallel`), an engine outside a run (`build_offline`,
for `rlloom export` and `rlloom eval`) and a checkpoint's weights (`read_model_tensors`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from rlloom.config import ConfigError, RunConfig, TrainEngineConfig
from rlloom.engines.train.base import TrainEngine
from rlloom.models.adapter import CheckpointMismatch
from rlloom.models.args import ModelArgs
from rlloom.parallel.dims import ParallelDims
from rlloom.parallel.pp_stages import check_pp, split_layers


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
    setting: str = "model.path",
    **kind: Any,
) -> TrainEngine:
    """The native engine over `model_path` in the run's parallel layout and schedule length; `kind`:
    `frozen` (the reference, the teacher) or `head` (the critic). A checkpoint whose tensors do not fit
    its config.json is reported under `setting`, the one that named it."""
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
        raise CheckpointMismatch(f"{setting}={model_path!r} is invalid: {e}") from None


def build_train_engine(cfg: RunConfig, *, device: torch.device, dtype: torch.dtype) -> TrainEngine:
    """This rank's training engine: the policy with its optimizer, in the run's parallel layout."""
    if not cfg.rollout.match_training:
        return _native(cfg, cfg.train, cfg.model.path, device=device, dtype=dtype)
    # The rollout's numerics (models/exact.py), eager as the rollout's are: a compiled layer would
    # fuse and round differently. One rank, no PP (config checks): the module is the PolicyHead.
    train = dataclasses.replace(cfg.train, compile=False)
    engine = _native(cfg, train, cfg.model.path, device=device, dtype=dtype)
    engine.module.exact = True
    return engine


def build_reference(cfg: RunConfig, *, device: torch.device, dtype: torch.dtype) -> TrainEngine:
    """The frozen reference policy (the initial weights) for the KL loss: forward-only, in the
    compute dtype and the run's layout, with no fp32 master copy, no gradients and no optimizer
    (only `forward_logprobs` is ever called on it)."""
    return _native(cfg, cfg.train, cfg.model.path, device=device, dtype=dtype, frozen=True)


def build_teacher(cfg: RunConfig, *, device: torch.device, dtype: torch.dtype) -> TrainEngine:
    """The frozen teacher of on-policy distillation (`teacher.path`), built as the reference is:
    forward-only, compute dtype, no optimizer, the run's layout (its own layers and heads split by the
    same degrees; `check_parallel` checks them against its config at start-up)."""
    return _native(
        cfg, cfg.train, cfg.teacher.path, device=device, dtype=dtype, setting="teacher.path", frozen=True
    )


def build_critic(cfg: RunConfig, *, device: torch.device, dtype: torch.dtype) -> TrainEngine:
    """The critic of PPO (algorithm.estimator=gae): a value model (`ValueHead`) with its own optimizer,
    started from `critic.model_path` (or the policy's checkpoint) in the run's layout; the `train`
    section's settings with the critic's learning rate and clipping."""
    setting = "critic.model_path" if cfg.critic.model_path else "model.path"
    return _native(
        cfg,
        critic_engine_config(cfg),
        cfg.critic_model_path,
        device=device,
        dtype=dtype,
        setting=setting,
        head="value",
    )


def build_offline(cfg: RunConfig, model_path: str, *, critic: bool = False) -> TrainEngine:
    """The policy (with `critic`, the critic) of `cfg` over `model_path` as one unsharded process's
    engine on CPU in fp32, whatever layout the run had: for reading and exporting a checkpoint."""
    from rlloom.engines.train.native import NativeTrainEngine

    engine_cfg, kind = (critic_engine_config(cfg), {"head": "value"}) if critic else (cfg.train, {})
    return NativeTrainEngine.build(
        engine_cfg, model_path, device="cpu", dtype=torch.float32, total_steps=_optimizer_steps(cfg), **kind
    )


def read_model_tensors(folder: Path) -> dict[str, Any]:
    """The full model weights of an engine's checkpoint folder (`save`), on CPU, under the native
    CausalLM's `state_dict` names."""
    from rlloom.engines.train.native.checkpoint import read_model_tensors as read

    return read(folder)


def critic_engine_config(cfg: RunConfig) -> TrainEngineConfig:
    """The critic's engine settings: the `train` section's with the critic's learning rate and clipping
    (a full model: LoRA adapts the policy only)."""
    return dataclasses.replace(cfg.train, lr=cfg.critic.lr, grad_clip=cfg.critic.grad_clip, lora_rank=0)


def check_parallel(cfg: RunConfig, hf_config: dict[str, Any], setting: str = "model.path") -> None:
    """The parallel degrees against the shapes of the model `setting` names (the policy's, or the
    teacher's); the world-size rules are checked with the config itself (`RunConfig.__post_init__`)."""
    par = cfg.parallel
    if par.tp == par.pp == par.cp == par.ep == 1:
        return
    args = None
    try:
        args = ModelArgs.from_hf_config(hf_config)
        dims = ParallelDims(world_size=cfg.cluster.num_workers, tp=par.tp, pp=par.pp, cp=par.cp, ep=par.ep)
        dims.check_model(args)
        if par.pp > 1:
            check_pp(args, par.pp, par.schedule, par.pp_virtual_stages)
            split_layers(
                args.num_layers,
                par.pp * par.pp_virtual_stages,
                first_stage_layers=par.pp_first_stage_layers,
                last_stage_layers=par.pp_last_stage_layers,
            )
    except ValueError as e:
        factors = (
            ""
            if args is None
            else f"; num_hidden_layers={args.num_layers}, cluster.num_workers={cfg.cluster.num_workers} = pp "
            f"{par.pp} x dp x cp {par.cp} x tp {par.tp}, ep={par.ep}, pp_virtual_stages={par.pp_virtual_stages}"
        )
        path = cfg.teacher.path if setting == "teacher.path" else cfg.model.path
        raise ConfigError(f"{' '.join(str(e).split())} ({setting}={path!r}{factors})") from None
