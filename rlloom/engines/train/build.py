"""`build_train_engine` and `build_reference`: the training backend a run asks for, picked with a
plain `if` (one backend, `native`, today). Workers build their engines only through these."""

from __future__ import annotations

import torch

from rlloom.config.components import RunConfig
from rlloom.engines.train.base import TrainEngine


def _optimizer_steps(cfg: RunConfig) -> int:
    t = cfg.trainer
    return t.total_steps * t.ppo_epochs * t.num_mini_batches


def build_train_engine(cfg: RunConfig, *, device: torch.device, dtype: torch.dtype) -> TrainEngine:
    """This rank's training engine: the policy with its optimizer, in the run's parallel layout."""
    from rlloom.engines.train.native import NativeTrainEngine

    return NativeTrainEngine.build(
        cfg.train, cfg.model.path, device=device, dtype=dtype, total_steps=_optimizer_steps(cfg)
    )


def build_reference(cfg: RunConfig, *, device: torch.device, dtype: torch.dtype) -> TrainEngine:
    """The frozen reference policy (the initial weights) for the KL loss: only `forward_logprobs`
    is ever called on it."""
    from rlloom.engines.train.native import NativeTrainEngine

    return NativeTrainEngine.build(
        cfg.train, cfg.model.path, device=device, dtype=dtype, total_steps=_optimizer_steps(cfg)
    )
