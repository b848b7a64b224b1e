"""Training curves of a run: `plot_run(run_dir)` reads metrics.jsonl and writes curves.png.

One panel per quantity that the run logged (reward, accuracy, response length, KL, step time);
panels whose metrics are absent are left out. Uses matplotlib's object API with the Agg canvas, so
it needs no display and leaves the global pyplot backend alone. Needs `pip install rlloom[plot]`.
"""

from __future__ import annotations

from pathlib import Path

from rlloom.observability.jsonl import read_metrics_jsonl
from rlloom.observability.loggers import METRICS_FILE

CURVES_FILE = "curves.png"
"""File name of the plot inside a run folder."""

# (panel title, metric keys drawn in it, one line each when present).
PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward (mean)", ("reward/mean",)),
    ("accuracy", ("train/accuracy", "eval/accuracy")),
    ("response length (tokens)", ("response/length_mean",)),
    ("KL to reference", ("kl/mean", "loss/kl")),
    ("step time (s)", ("time/step_s",)),
)


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
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError(
            "plotting needs matplotlib, which is not installed. Fix: pip install 'rlloom[plot]'."
        ) from error

    run_dir = Path(run_dir)
    series = series_by_key(read_metrics_jsonl(run_dir / METRICS_FILE))
    panels = [(title, [k for k in keys if k in series]) for title, keys in PANELS]
    panels = [(title, keys) for title, keys in panels if keys]
    if not panels:
        known = sorted(k for _, keys in PANELS for k in keys)
        raise ValueError(
            f"{run_dir / METRICS_FILE} has none of the plotted metrics {known} (it has {sorted(series)}). "
            "Fix: plot a run folder written by `rlloom train`."
        )

    num_cols = min(3, len(panels))
    num_rows = -(-len(panels) // num_cols)
    fig = Figure(figsize=(4.5 * num_cols, 3.2 * num_rows), layout="constrained")
    fig.suptitle(run_dir.name)
    for index, (title, keys) in enumerate(panels):
        ax = fig.add_subplot(num_rows, num_cols, index + 1)
        for key in keys:
            steps, values = series[key]
            # Sparse series (evaluation every k steps) get markers so single points stay visible.
            ax.plot(steps, values, label=key, marker="o" if len(steps) < 30 else None, markersize=3)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend(fontsize="small")
    out = run_dir / CURVES_FILE
    fig.savefig(out, dpi=100)
    return out
