"""The metrics-logger interface (`log`/`close`), fan-out to several backends, and the factory.

Backends: `ConsoleLogger` (console.py), `JsonlLogger` (jsonl.py), `TensorBoardLogger`
(tensorboard.py). The trainer builds them once from `LoggingConfig` on the main rank only (other
ranks log nothing) and calls `log(step, metrics)` once per step with everything for that step:

    logger = build_loggers(cfg.logging, run_dir, resume_from_step, total_steps=cfg.trainer.total_steps)
    logger.log(step, {"reward/mean": 0.42, "time/step_s": 3.1})
    logger.close()
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from pathlib import Path

from rlloom.config.components import LoggingConfig

METRICS_FILE = "metrics.jsonl"
"""File name of the JSONL metrics log inside a run folder."""
TENSORBOARD_DIR = "tensorboard"
"""Folder name of the TensorBoard event files inside a run folder."""


class Logger(ABC):
    """Receives one dict of scalar metrics per step."""

    @abstractmethod
    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record `metrics` (keys `component/quantity_unit`, float values) for RL step `step`."""

    def close(self) -> None:
        """Flush and release files or displays. Safe to call twice."""
        return None

    def __enter__(self) -> Logger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MultiLogger(Logger):
    """Sends every call to each of its loggers, in order."""

    def __init__(self, loggers: Sequence[Logger]) -> None:
        self.loggers = list(loggers)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for logger in self.loggers:
            logger.log(step, metrics)

    def close(self) -> None:
        # Close every backend even if one fails, then re-raise the first failure.
        first_error: BaseException | None = None
        for logger in self.loggers:
            try:
                logger.close()
            except Exception as error:
                first_error = first_error or error
        if first_error is not None:
            raise first_error


def build_loggers(
    logging_cfg: LoggingConfig,
    run_dir: str | Path,
    resume_from_step: int | None = None,
    *,
    total_steps: int | None = None,
) -> MultiLogger:
    """The loggers `logging_cfg` turns on, writing into `run_dir`.

    `resume_from_step`: the first step the resumed run will log; the JSONL and TensorBoard logs drop
    anything recorded at that step or later, so a resumed run's logs match an uninterrupted run's.
    `None` starts fresh (an existing metrics.jsonl is overwritten). `total_steps` feeds the console
    progress line and ETA.
    """
    from rlloom.observability.console import ConsoleLogger
    from rlloom.observability.jsonl import JsonlLogger
    from rlloom.observability.tensorboard import TensorBoardLogger

    run_dir = Path(run_dir)
    loggers: list[Logger] = []
    # TensorBoard first: it is the one that can fail on a missing package, before files are touched.
    if logging_cfg.tensorboard:
        loggers.append(TensorBoardLogger(run_dir / TENSORBOARD_DIR, resume_from_step=resume_from_step))
    if logging_cfg.jsonl:
        loggers.append(JsonlLogger(run_dir / METRICS_FILE, resume_from_step=resume_from_step))
    if logging_cfg.console:
        loggers.append(ConsoleLogger(total_steps=total_steps))
    return MultiLogger(loggers)
