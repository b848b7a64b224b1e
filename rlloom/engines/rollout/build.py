"""`build_rollout_engine`: the rollout backend a run asks for, picked with a plain `if` (one backend,
`native`, today). Workers build their engine only through this function."""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlloom.config.components import RunConfig
from rlloom.engines.rollout.base import RolloutEngine
from rlloom.models import from_pretrained, load_decoder


def build_rollout_engine(
    cfg: RunConfig,
    *,
    device: torch.device,
    dtype: torch.dtype,
    tp_group: dist.ProcessGroup | None = None,
) -> RolloutEngine:
    """One rollout replica (or, with `tp_group`, this rank's part of a tensor-parallel replica) with
    the checkpoint's weights in `dtype` on `device`."""
    from rlloom.engines.rollout.native import NativeEngine

    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        raise ValueError(
            f"rollout.tp={dist.get_world_size(tp_group)} is not supported by the native rollout engine yet. "
            "Fix: set rollout.tp=1."
        )
    return NativeEngine.from_config(
        from_pretrained(cfg.model.path, dtype=dtype, device=device, fused_projections=True),
        cfg.rollout,
        max_model_len=cfg.data.max_prompt_length + cfg.rollout.max_new_tokens,
        decode=load_decoder(cfg.model.path),
        seed=cfg.trainer.seed,
    )
