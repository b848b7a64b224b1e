"""Training curves of a run: `plot_run(run_dir)` reads metrics.jsonl and writes curves.png.

One panel per quantity that the run logged: reward with a band of +-1 standard deviation across the
step's samples, accuracy (train and eval), loss, KL (to the reference, and the update's approximate
KL to the rollout policy), entropy, gradient norm, clip fractions (PPO ratio clipping, and responses
cut at rollout.max_new_tokens), response length and step time. Panels whose metrics are absent are
left out; the x axis is the RL step, with integer ticks. Uses matplotlib's object API with the Agg
canvas, so it needs no display and leaves the global pyplot backend alone. Needs
`pip install rlloom[plot]`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rlloom.config import UserError
from rlloom.observability.jsonl import read_metrics_jsonl
from rlloom.observability.loggers import METRICS_FILE
from rlloom.run_files import open_fd

if TYPE_CHECKING:
    from matplotlib.figure import Figure

CURVES_FILE = "curves.png"
"""File name of the plot inside a run folder."""


@dataclass(frozen=True, slots=True)
class Panel:
    """One subplot: a line per metric key present, and optionally a band of mean +- std."""

    title: str
    keys: tuple[str, ...]
    band: tuple[str, str] | None = None
    """(mean key, std key): shade mean - std .. mean + std (the spread across the step's samples)."""


PANELS: tuple[Panel, ...] = (
    Panel("reward (mean, +-1 std across samples)", ("reward/mean",), band=("reward/mean", "reward/std")),
    Panel("accuracy", ("train/accuracy", "eval/accuracy")),
    Panel("loss", ("train/loss",)),
    Panel("KL", ("loss/kl", "kl/mean", "loss/approx_kl")),
    Panel("entropy (nats/token)", ("actor/entropy",)),
    Panel("gradient norm", ("train/grad_norm",)),
    Panel(
        "clip fractions",
        ("loss/clipfrac_low", "loss/clipfrac_high", "loss/dual_clipfrac", "response/clip_frac"),
    ),
    Panel("critic (PPO): value loss, explained variance", ("critic/vf_loss", "critic/vf_explained_var")),
    Panel("response length (tokens)", ("response/length_mean", "response/length_max")),
    Panel("step time (s)", ("time/step_s",)),
)
LEGEND_NAMES = {"response/clip_frac": "response/clip_frac (cut at max_new_tokens)"}


def series_by_key(records: list[dict]) -> dict[str, tuple[list[int], list[float]]]:
    """`{key: (steps, values)}` sorted by step; a key logged twice at one step keeps the later value."""
    by_key: dict[str, dict[int, float]] = {}
    for record in records:
        step = record["step"]
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                by_key.setdefault(key, {})[step] = float(value)
    return {key: (sorted(points), [points[s] for s in sorted(points)]) for key, points in by_key.items()}


def plot_run(run_dir: str | Path) -> Path:
    """Write `run_dir/curves.png` from `run_dir/metrics.jsonl` and return its path."""
    out = Path(run_dir) / CURVES_FILE
    figure = curves_figure(run_dir)
    with os.fdopen(open_fd(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb") as f:
        figure.savefig(f, dpi=100, format="png")
    return out


def curves_figure(run_dir: str | Path) -> Figure:
    """The figure of `plot_run`: one panel (an Axes titled as in PANELS) per quantity the run logged."""
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise UserError(
            "rlloom plot needs matplotlib, which is not installed. Fix: pip install 'rlloom[plot]'."
        ) from error

    from matplotlib.ticker import MaxNLocator

    run_dir = Path(run_dir)
    series = series_by_key(read_metrics_jsonl(run_dir / METRICS_FILE))
    panels = [(panel, [k for k in panel.keys if k in series]) for panel in PANELS]
    panels = [(panel, keys) for panel, keys in panels if keys]
    if not panels:
        known = sorted(k for panel in PANELS for k in panel.keys)
        raise UserError(
            f"{run_dir / METRICS_FILE} has none of the plotted metrics {known} (it has {sorted(series)}). "
            "Fix: plot a run folder written by `rlloom train`."
        )

    num_cols = min(3, len(panels))
    num_rows = -(-len(panels) // num_cols)
    fig = Figure(figsize=(4.5 * num_cols, 3.2 * num_rows), layout="constrained")
    fig.suptitle(run_dir.name)
    for index, (panel, keys) in enumerate(panels):
        ax = fig.add_subplot(num_rows, num_cols, index + 1)
        if panel.band and all(k in series for k in panel.band):
            steps, low, high = band_points(series[panel.band[0]], series[panel.band[1]])
            ax.fill_between(steps, low, high, alpha=0.25, label="+-1 std")
        for key in keys:
            steps, values = series[key]
            # Sparse series (evaluation every k steps) get markers so single points stay visible.
            marker = "o" if len(steps) < 30 else None
            ax.plot(steps, values, label=LEGEND_NAMES.get(key, key), marker=marker, markersize=3)
        ax.set_title(panel.title)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        ax.grid(alpha=0.3)
        if len(panel.keys) > 1 or panel.band:
            ax.legend(fontsize="small")
    return fig


def band_points(
    mean: tuple[list[int], list[float]], std: tuple[list[int], list[float]]
) -> tuple[list[int], list[float], list[float]]:
    """(steps, mean - std, mean + std) at the steps where both were logged."""
    spread = dict(zip(*std))
    steps = [s for s in mean[0] if s in spread]
    centre = dict(zip(*mean))
    return steps, [centre[s] - spread[s] for s in steps], [centre[s] + spread[s] for s in steps]
