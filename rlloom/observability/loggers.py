"""The loggers of a run, built from `LoggingConfig` (the interface they share is logger.py).

Backends: `ConsoleLogger` (console.py), `JsonlLogger` (jsonl.py), `TensorBoardLogger`
(tensorboard.py), `WandbLogger` (wandb_logger.py) and `SamplesLogger` (samples.py, the sample
completions). The trainer builds them once from `LoggingConfig` on the main rank only (other ranks
log nothing) and calls `log(step, metrics)` once per step with everything for that step, then
`log_samples(step, records)` with a few of the step's completions:

    logger = build_loggers(cfg.logging, run_dir, resume_from_step, total_steps=cfg.trainer.total_steps)
    logger.log(step, {"reward/mean": 0.42, "time/step_s": 3.1})
    logger.log_samples(step, [SampleRecord(step=step, prompt="2 + 3?", response="5", ...)])
    logger.close()
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlloom.config import LoggingConfig
from rlloom.observability.logger import Logger, MultiLogger
from rlloom.observability.samples import SAMPLES_FILE
from rlloom.observability.wandb_logger import RUN_ID_FILE

METRICS_FILE = "metrics.jsonl"
"""File name of the JSONL metrics log inside a run folder."""
TENSORBOARD_DIR = "tensorboard"
"""Folder name of the TensorBoard event files inside a run folder."""
LOG_NAMES = (METRICS_FILE, SAMPLES_FILE, TENSORBOARD_DIR, RUN_ID_FILE, "wandb")
"""What the loggers write at the top of a run folder (a link planted there is refused at start-up)."""


def build_loggers(
    logging_cfg: LoggingConfig,
    run_dir: str | Path,
    resume_from_step: int | None = None,
    *,
    total_steps: int | None = None,
    config: Mapping[str, Any] | None = None,
) -> MultiLogger:
    """The loggers `logging_cfg` turns on, writing into `run_dir`.

    `resume_from_step`: the first step the resumed run will log; the JSONL, samples and TensorBoard
    logs drop anything recorded at that step or later, so a resumed run's logs match an uninterrupted
    run's. `None` starts fresh (an existing metrics.jsonl is overwritten). `total_steps` feeds the
    console progress line and ETA; `config` (the resolved config as plain data) goes to W&B.
    """
    from rlloom.observability.console import ConsoleLogger
    from rlloom.observability.jsonl import JsonlLogger
    from rlloom.observability.samples import SamplesLogger
    from rlloom.observability.tensorboard import TensorBoardLogger
    from rlloom.observability.wandb_logger import WandbLogger

    run_dir = Path(run_dir)
    loggers: list[Logger] = []
    # TensorBoard and W&B first: they can fail on a missing package, before files are touched.
    if logging_cfg.tensorboard:
        loggers.append(TensorBoardLogger(run_dir / TENSORBOARD_DIR, resume_from_step=resume_from_step))
    if logging_cfg.wandb:
        loggers.append(
            WandbLogger(
                run_dir,
                project=logging_cfg.wandb_project,
                name=run_name(logging_cfg, run_dir),
                config=config,
                resume_from_step=resume_from_step,
            )
        )
    if logging_cfg.jsonl:
        loggers.append(JsonlLogger(run_dir / METRICS_FILE, resume_from_step=resume_from_step))
    if logging_cfg.console:
        first_step = resume_from_step if resume_from_step is not None else 1
        loggers.append(ConsoleLogger(total_steps=total_steps, first_step=first_step))
    if logging_cfg.samples_per_step > 0:
        samples = SamplesLogger(
            run_dir / SAMPLES_FILE, resume_from_step=resume_from_step, console=logging_cfg.console
        )
        loggers.append(samples)
    return MultiLogger(loggers)


def run_name(logging_cfg: LoggingConfig, run_dir: str | Path) -> str:
    """The run's name: `logging.run_name`, or the run folder's name when that is empty."""
    return logging_cfg.run_name or Path(run_dir).resolve().name
