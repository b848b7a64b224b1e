"""The `logging` section: console, metrics files, TensorBoard, Weights & Biases, sample printing."""

from __future__ import annotations

from dataclasses import dataclass

from rlloom.config.checks import check


@dataclass(kw_only=True, slots=True)
class LoggingConfig:
    console: bool = True
    """Live progress line on the console."""
    jsonl: bool = True
    """Write metrics.jsonl in the run folder."""
    tensorboard: bool = False
    """Write TensorBoard events (needs `pip install rlloom[tensorboard]`)."""
    wandb: bool = False
    """Log metrics and the sample completions to Weights & Biases (needs `pip install rlloom[wandb]`).
    With the environment variable WANDB_MODE=offline it writes RUN_DIR/wandb without an account
    (`wandb sync` uploads it later)."""
    wandb_project: str = "rlloom"
    """The W&B project the run is logged to (with logging.wandb=true)."""
    run_name: str = ""
    """The run's name in the summary line and in W&B; empty = the run folder's name."""
    samples_per_step: int = 2
    """Sample completions (prompt, response, reward) per step printed to the console (with
    logging.console=true) and appended to RUN_DIR/samples.jsonl; 0 = none."""

    def __post_init__(self) -> None:
        check(
            self.samples_per_step >= 0,
            "logging.samples_per_step",
            self.samples_per_step,
            "must be >= 0",
            "use 0 (no samples) or a small count such as 2",
        )
        check(
            bool(self.wandb_project.strip()),
            "logging.wandb_project",
            self.wandb_project,
            "must name a W&B project",
            "e.g. logging.wandb_project=my_project",
        )
