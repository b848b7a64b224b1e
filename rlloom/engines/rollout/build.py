"""`build_rollout_engine`: the rollout backend a run asks for, picked with a plain `if` (one backend,
`native`, today). Workers build their engine only through this function."""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlloom.config import RunConfig
from rlloom.engines.rollout.base import RolloutEngine
from rlloom.models import from_pretrained, load_decoder


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
        max_model_len=cfg.data.max_prompt_length + cfg.rollout.max_new_tokens,
        decode=load_decoder(cfg.model.path),
        seed=cfg.trainer.seed,
        tp_group=tp_group,
    )
