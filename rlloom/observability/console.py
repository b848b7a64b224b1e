"""Console progress: one plain line per step, and on a terminal a live progress bar below them.

Each `log` call prints one line that stays in the terminal's history (and in CI logs, `make demo |
tee`), e.g.

    [rlloom] step 0/20 | eval_acc 0.100
    [rlloom] step 1/20 | reward 0.250 | acc 0.250 | entropy 0.812 | 9.87 s/step (warm-up) | eta after warm-up
    [rlloom] step 3/20 | reward 0.500 | acc 0.250 | eval_acc 0.300 | kl 0.0012 | entropy 0.790 | 1.23 s/step | eta 0:00:21

On a TTY, rich also redraws a bar with step/total in place under them; whatever else is printed or
logged appears above it. `reward` is the mean reward of the samples the step trained on
(`reward/trained_mean`; under dynamic sampling the kept groups of every sampling round, where
`reward/mean` describes the first round's samples, kept or not); `kl` is the KL term's estimate
(`loss/kl` as a loss term, `reward/kl` in the reward), shown only when a KL term is on.

A step some of whose rewards failed (the function raised, hung or returned no number: they scored
`reward.default_score`) says how many after the reward, `reward 0.000 | reward_failed 8 | ...`.
Fields whose metric has not been logged yet are left out; a training metric's last value is shown
until a new one arrives, evaluation metrics only on the steps that evaluated. The first step of a
process (`first_step`: 1, or the step a resume starts at) compiles kernels and fills caches, so its
time is labelled warm-up and the ETA leaves it out: the ETA is the wall-clock time per step since
the first step ended (evaluation and checkpoints included) times the steps left.
"""

from __future__ import annotations

import datetime
import sys
import time
from collections.abc import Mapping
from typing import TextIO

from rlloom.observability.logger import Logger

# (label, metric key, format) shown in this order when present.
FIELDS: tuple[tuple[str, str, str], ...] = (
    ("sft_loss", "sft/loss", "{:.4f}"),  # rlloom sft
    ("reward", "reward/trained_mean", "{:.3f}"),
    ("acc", "train/accuracy", "{:.3f}"),
    ("eval_acc", "eval/accuracy", "{:.3f}"),
    ("len", "response/length_mean", "{:.0f}"),
    ("kl", "loss/kl", "{:.4f}"),
    ("kl", "reward/kl", "{:.4f}"),
    ("entropy", "actor/entropy", "{:.3f}"),
)
REWARD_FAILURE_KEYS = ("reward/errors", "reward/timeouts", "reward/invalid")
"""Their sum, the step's samples whose reward failed, is shown after the reward when it is not 0."""
STEP_TIME_KEY = "time/step_s"
EVAL_PREFIX = "eval/"
"""Metrics with this prefix are shown only on the steps that log them."""


def format_eta(seconds: float) -> str:
    """`H:MM:SS` for a non-negative number of seconds (rounded to whole seconds)."""
    return str(datetime.timedelta(seconds=round(max(seconds, 0.0))))


class ConsoleLogger(Logger):
    """Shows training progress; see the module docstring for the line format."""

    def __init__(
        self,
        total_steps: int | None = None,
        file: TextIO | None = None,
        live: bool | None = None,
        *,
        first_step: int = 1,
    ) -> None:
        """`file` defaults to stdout; `live=None` redraws in place only when `file` is a TTY;
        `first_step` is the warm-up step (the first this process trains)."""
        self.total_steps = total_steps
        self.first_step = first_step
        self._warm: tuple[int, float] | None = None  # the warm-up step and when it was logged
        self._file = file if file is not None else sys.stdout
        if live is None:
            isatty = getattr(self._file, "isatty", None)
            live = bool(isatty and isatty())
        self._live_enabled = live
        self._live = None  # rich.live.Live, started on the first log call
        self._last: dict[str, float] = {}
        self._start = time.monotonic()
        self._steps_seen: list[int] = []
        self._last_step_time: float | None = None
        self._last_step_at = self._start

    def _step_seconds(self, metrics: Mapping[str, float], now: float, new_step: bool) -> float | None:
        if STEP_TIME_KEY in metrics:
            return float(metrics[STEP_TIME_KEY])
        if new_step:
            # No step timer in the metrics: use the wall time between steps.
            return now - self._last_step_at
        return self._last_step_time

    def line(self, step: int, metrics: Mapping[str, float]) -> str:
        """Fold `metrics` into the shown state and return the progress line (without the tag)."""
        now = time.monotonic()
        new_step = not self._steps_seen or self._steps_seen[-1] != step
        self._last_step_time = self._step_seconds(metrics, now, new_step)
        if new_step:
            self._steps_seen.append(step)
            self._last_step_at = now
        if step >= self.first_step and self._warm is None:
            self._warm = (step, now)
        self._last.update({k: float(v) for k, v in metrics.items() if not k.startswith(EVAL_PREFIX)})
        shown = {**self._last, **{k: float(v) for k, v in metrics.items() if k.startswith(EVAL_PREFIX)}}

        parts = [f"step {step}/{self.total_steps}" if self.total_steps else f"step {step}"]
        for label, key, fmt in FIELDS:
            if key in shown:
                parts.append(f"{label} {fmt.format(shown[key])}")
            if key == "reward/trained_mean" and (
                failed := sum(shown.get(k, 0.0) for k in REWARD_FAILURE_KEYS)
            ):
                parts.append(f"reward_failed {failed:.0f}")  # samples scored reward.default_score
        if step < self.first_step:  # the evaluation before training: no step time or ETA yet
            return " | ".join(parts)
        warm_up = self._warm is not None and step == self._warm[0]
        if self._last_step_time is not None:
            parts.append(f"{self._last_step_time:.2f} s/step" + (" (warm-up)" if warm_up else ""))
        if self.total_steps:
            parts.append(f"eta {self._eta(step, now)}")
        return " | ".join(parts)

    def _eta(self, step: int, now: float) -> str:
        """Wall-clock time per step since the warm-up step ended, times the steps left."""
        if self._warm is None or step <= self._warm[0]:
            return "after warm-up"
        rate = (now - self._warm[1]) / (step - self._warm[0])
        return format_eta(rate * max(self.total_steps - step, 0))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        text = f"[rlloom] {self.line(step, metrics)}"
        if not self._live_enabled:
            print(text, file=self._file, flush=True)
            return
        self._draw(step, text)

    def _draw(self, step: int, text: str) -> None:
        """Print the step's line above the live bar (it stays in the terminal's history), then
        redraw the bar."""
        from rich.console import Console
        from rich.live import Live
        from rich.progress_bar import ProgressBar
        from rich.table import Table

        row = Table.grid(padding=(0, 1))
        progress = f"step {step}/{self.total_steps}" if self.total_steps else f"step {step}"
        if self.total_steps:
            row.add_row(ProgressBar(total=self.total_steps, completed=step, width=24), progress)
        else:
            row.add_row(progress)
        if self._live is None:
            self._live = Live(row, console=Console(file=self._file), refresh_per_second=4)
            self._live.start()
        self._live.console.print(text, markup=False, highlight=False, soft_wrap=True)
        self._live.update(row)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
