"""TensorBoard event files, one scalar per metric key (needs `pip install rlloom[tensorboard]`).

On resume from step s, TensorBoard's own `purge_step` hides events at step >= s written before the
interruption, so the curves match an uninterrupted run's.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from rlloom.observability.logger import Logger
from rlloom.run_files import make_dir


class TensorBoardLogger(Logger):
    """Writes each metric as a TensorBoard scalar under its key (`reward/mean` groups by `reward`)."""

    def __init__(self, log_dir: str | Path, resume_from_step: int | None = None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            raise ImportError(
                "logging.tensorboard=true needs the tensorboard package, which is not installed. "
                "Fix: pip install 'rlloom[tensorboard]', or set logging.tensorboard=false."
            ) from error
        self._writer = SummaryWriter(log_dir=str(make_dir(log_dir)), purge_step=resume_from_step)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, float(value), global_step=step)
        # Flush each step so a crash loses nothing (the default is every 120 s).
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
