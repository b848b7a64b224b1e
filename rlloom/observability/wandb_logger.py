"""Weights & Biases: metrics as W&B scalars, sample completions as a table (needs `pip install rlloom[wandb]`).

`logging.wandb=true` logs to the project `logging.wandb_project` under the run's name
(`logging.run_name`, default the run folder's name), with the resolved config. W&B's files go to
RUN_DIR/wandb; the environment variable WANDB_MODE=offline keeps them there without an account
(`wandb sync RUN_DIR/wandb/offline-run-*` uploads them later). The W&B run id is kept in
RUN_DIR/wandb_run_id, so a resumed rlloom run continues the same W&B run.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rlloom.observability.logger import Logger, SampleRecord
from rlloom.run_files import refuse_link, write_text

RUN_ID_FILE = "wandb_run_id"
"""File inside a run folder holding the W&B run id (a resume continues that W&B run)."""
SAMPLE_COLUMNS = ("step", "prompt", "response", "reward", "ground_truth", "finish_reason")


def run_id(run_dir: Path, resume: bool) -> str:
    """The W&B id of this run: the stored one when resuming, else a new one (stored)."""
    path = run_dir / RUN_ID_FILE
    if resume and path.is_file():
        return path.read_text().strip()
    new = uuid.uuid4().hex[:16]
    write_text(path, new + "\n")
    return new


class WandbLogger(Logger):
    """Sends each step's metrics to one W&B run, and the sample completions as a `samples` table."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        project: str,
        name: str,
        config: Mapping[str, Any] | None = None,
        resume_from_step: int | None = None,
    ) -> None:
        try:
            import wandb
        except ImportError as error:
            raise ImportError(
                "logging.wandb=true needs the wandb package, which is not installed. "
                "Fix: pip install 'rlloom[wandb]', or set logging.wandb=false."
            ) from error
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        refuse_link(run_dir / "wandb")  # W&B writes its files there
        self._wandb = wandb
        self._run = wandb.init(
            project=project,
            name=name,
            dir=str(run_dir),
            id=run_id(run_dir, resume_from_step is not None),
            resume="allow",
            config=dict(config or {}),
        )
        self._rows: list[list[Any]] = []

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log({key: float(value) for key, value in metrics.items()}, step=step)

    def log_samples(self, step: int, records: Sequence[SampleRecord]) -> None:
        if not records:
            return
        # W&B tables are immutable once logged: log the growing table, as TRL does with its completions.
        self._rows.extend([asdict(r)[c] for c in SAMPLE_COLUMNS] for r in records)
        table = self._wandb.Table(columns=list(SAMPLE_COLUMNS), data=self._rows)
        self._run.log({"samples": table}, step=step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None
