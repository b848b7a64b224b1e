"""Learning-rate schedule: linear warmup, then constant, linear decay to 0, or cosine decay to a floor.

A pure function of the optimizer step, so the schedule's whole state is the step counter the
engine checkpoints anyway (no LR-scheduler object to save or to keep in sync with two optimizers).
"""

from __future__ import annotations

import math

from rlloom.config import TrainEngineConfig


def lr_at(step: int, cfg: TrainEngineConfig, total_steps: int | None) -> float:
    """Learning rate of optimizer step `step` (0 for the first step).

    Warmup: lr * (step + 1) / warmup_steps for the first warmup_steps steps. After warmup the
    decay runs over the remaining total_steps - warmup_steps steps: linear reaches 0 and cosine
    reaches min_lr_ratio * lr at step total_steps (and stays there after it).
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    if total_steps is None or total_steps <= cfg.warmup_steps:
        raise ValueError(
            f"train.lr_schedule={cfg.lr_schedule!r} needs the number of optimizer steps of the run, but "
            f"total_steps={total_steps} (warmup_steps={cfg.warmup_steps}). Fix: build the engine with "
            "total_steps > warmup_steps, or use train.lr_schedule=constant."
        )
    progress = min((step - cfg.warmup_steps) / (total_steps - cfg.warmup_steps), 1.0)
    if cfg.lr_schedule == "linear":
        return cfg.lr * (1.0 - progress)
    floor = cfg.min_lr_ratio * cfg.lr
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
