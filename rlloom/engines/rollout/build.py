"""`build_rollout_engine`: the rollout backend a run asks for, picked with a plain `if` (one backend,
`native`, today). Workers build their engine only through this function, and the start-up checks
ask it what the backend can tell before any model loads (`check_rollout`)."""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
import torch.distributed as dist

from rlloom.config import ConfigError, RunConfig
from rlloom.devices import resolve_device, resolve_dtype
from rlloom.engines.rollout.base import RolloutEngine
from rlloom.engines.rollout.native.tensor_parallel import tp_problem
from rlloom.engines.rollout.native.validation import kv_cache_blocks
from rlloom.models import from_pretrained, load_decoder
from rlloom.models.args import ModelArgs
from rlloom.models.fp8 import FP8_NEEDS_EXPERTS


def build_rollout_engine(
    cfg: RunConfig,
    *,
    device: torch.device,
    dtype: torch.dtype,
    tp_group: dist.ProcessGroup | None = None,
) -> RolloutEngine:
    """One rollout replica (or, with `tp_group`, this rank's part of a tensor-parallel replica of
    `rollout.tp` ranks, every rank calling every engine method alike) with the checkpoint's weights in
    `dtype` on `device`."""
    from rlloom.engines.rollout.native import NativeEngine
    from rlloom.engines.rollout.native.tp_weights import from_pretrained_sharded

    group_size = 1 if tp_group is None else dist.get_world_size(tp_group)
    if group_size != cfg.rollout.tp:
        raise ValueError(
            f"rollout.tp={cfg.rollout.tp} but the rollout engine was given a tensor-parallel group of "
            f"{group_size} ranks. Fix: create one group of rollout.tp ranks per rollout replica."
        )
    if group_size > 1:  # each rank loads only its shard
        model = from_pretrained_sharded(cfg.model.path, tp_group, dtype=dtype, device=device)
    else:
        model = from_pretrained(cfg.model.path, dtype=dtype, device=device, fused_projections=True)
    return NativeEngine.from_config(
        model,
        cfg.rollout,
        max_model_len=cfg.longest_sequence,
        enable_prefix_caching=cfg.rollout.multi_turn,
        decode=load_decoder(cfg.model.path),
        seed=cfg.trainer.seed,
        tp_group=tp_group,
    )


def check_rollout(cfg: RunConfig, hf_config: dict[str, Any]) -> None:
    """Raise ConfigError for what the rollout backend can tell about the model of `hf_config` (its
    config.json) before loading it: rollout.tp splits it evenly, rollout.quantization=fp8 has experts
    to quantize, rollout.match_training has its kernels on the device, and (inline) the KV cache asked for fits in the device's free memory."""
    check_rollout_tp(cfg, hf_config)
    check_rollout_quantization(cfg, hf_config)
    check_match_training(cfg, hf_config)
    if cfg.cluster.mode == "inline":  # ray workers check their own devices when they build engines
        check_kv_cache(cfg, hf_config)


def _model_args(hf_config: dict[str, Any]) -> ModelArgs | None:
    """The model's args for a start-up check, or None where the config does not parse (check_kv_cache
    or the engine reports the model itself)."""
    try:
        return ModelArgs.from_hf_config(hf_config)
    except ValueError:
        return None


def check_rollout_tp(cfg: RunConfig, hf_config: dict[str, Any]) -> None:
    """rollout.tp must split the model's heads and widths evenly (the engine checks again)."""
    if cfg.rollout.tp == 1:
        return
    args = _model_args(hf_config)
    if args is None:
        return
    problem = tp_problem(args, cfg.rollout.tp)
    if problem is not None:
        raise ConfigError(f"{problem} ({cfg.model.path})")


def check_rollout_quantization(cfg: RunConfig, hf_config: dict[str, Any]) -> None:
    """rollout.quantization=fp8 needs routed experts to quantize (the engine checks again)."""
    if cfg.rollout.quantization == "none":
        return
    args = _model_args(hf_config)
    if args is None:
        return
    if args.moe is None:
        raise ConfigError(
            f"rollout.quantization={cfg.rollout.quantization!r} is invalid for {cfg.model.path} "
            f"({args.model_type}): {FP8_NEEDS_EXPERTS}. Fix: use rollout.quantization=none."
        )


def check_match_training(cfg: RunConfig, hf_config: dict[str, Any]) -> None:
    """rollout.match_training's batch-invariant numerics (models/exact.py) run on the CPU, and on CUDA
    through Triton kernels (models/exact_kernels.py, exact_attention.py): dense, MoE and MLA models
    alike. Not vision-language models: the rollout computes a prompt's image features once, outside
    the numerics, where training runs the tower inside them."""
    if not cfg.rollout.match_training:
        return
    if "vision_config" in hf_config:
        raise ConfigError(
            f"rollout.match_training=true does not cover vision-language models in this version "
            f"({cfg.model.path} is {hf_config.get('model_type', 'one')}: the rollout's image features are "
            "not batch-invariant). Fix: set rollout.match_training=false (watch rollout/logp_gap_max)."
        )
    _check_exact_tp(cfg, hf_config)
    try:
        device = resolve_device(cfg)
    except ValueError:
        return  # a device that is not there is reported on its own
    where = f"{device.type} (cluster.device={cfg.cluster.device})"
    if device.type == "cpu":
        return
    if device.type != "cuda":
        problem = f"is exact on the CPU and on CUDA GPUs in this version; the run would use {where}"
    elif importlib.util.find_spec("triton") is None:
        problem = "needs Triton on CUDA (its batch-invariant kernels are Triton's); it is not installed"
    else:
        return
    raise ConfigError(
        f"rollout.match_training=true {problem}. Fix: set rollout.match_training=false (watch "
        "rollout/logp_gap_max), or cluster.device=cpu."
    )


def _check_exact_tp(cfg: RunConfig, hf_config: dict[str, Any]) -> None:
    """Exact tensor parallelism (parallel.tp=2 into rollout.tp=2, config/run.py) covers dense models:
    the rollout splits every expert's width over its ranks and sums the halves, where training's
    tensor parallelism runs whole experts; DeepSeek-V3's absorbed attention, which exact numerics
    give training, takes no head-sharded weights."""
    if cfg.parallel.tp == 1:
        return
    args = _model_args(hf_config)
    if args is None:
        return
    if args.moe is not None or args.mla is not None:
        raise ConfigError(
            f"rollout.match_training=true covers parallel.tp={cfg.parallel.tp} for dense models only in "
            f"this version ({cfg.model.path} is {args.model_type}, with "
            f"{'mixture-of-experts layers' if args.moe is not None else 'MLA attention'}). Fix: set "
            "parallel.tp=1 and rollout.tp=1 (parallel.ep=2 is exact for MoE models), or "
            "rollout.match_training=false."
        )


def check_kv_cache(cfg: RunConfig, hf_config: dict[str, Any]) -> None:
    """The KV cache that rollout.num_blocks (or kv_cache_memory_gb) asks for must fit in the memory
    the device has free now; the engine checks again, exactly, right before it allocates."""
    try:
        device = resolve_device(cfg)
        args = ModelArgs.from_hf_config(hf_config)
    except ValueError as e:
        raise ConfigError(
            f"model.path={cfg.model.path!r} cannot run here: {' '.join(str(e).split())}"
        ) from None
    ro = cfg.rollout
    kv_cache_blocks(
        args,
        num_blocks=ro.num_blocks,
        kv_cache_memory_gb=ro.kv_cache_memory_gb,
        block_size=ro.block_size,
        dtype=resolve_dtype(cfg, device),
        device=device,
    )
