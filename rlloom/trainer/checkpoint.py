"""Run checkpoints: engine state + trainer state (step, data position) + config, written atomically.

Layout: RUN_DIR/checkpoints/step_000004/{engine/, trainer_state.json, config.yaml, COMPLETE}.
A checkpoint is built in a temporary sibling folder and renamed into place only when every file is
written, the `COMPLETE` marker last; `resume=auto` takes the newest folder that has the marker.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlloom.config.components import ConfigError, RunConfig
from rlloom.config.loading import to_yaml
from rlloom.trainer.faults import maybe_fail

MARKER = "COMPLETE"


@dataclass(kw_only=True, slots=True)
class TrainerState:
    """What the loop needs besides the engines to continue exactly."""

    step: int
    """Steps completed."""
    data_state: dict[str, Any]
    """The prompt source's position (epoch, cursor, ...)."""
    accuracy_before: float | None = None
    """Greedy eval accuracy of the initial policy (for the final report)."""


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:06d}"


def save_checkpoint(group: Any, cfg: RunConfig, state: TrainerState) -> Path:
    """Write a complete checkpoint for `state.step` and return its folder."""
    final = checkpoint_dir(cfg.trainer.run_dir, state.step)
    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    group.save(str(tmp / "engine"))
    maybe_fail("save_engine", state.step)
    (tmp / "trainer_state.json").write_text(
        json.dumps(
            {"step": state.step, "data_state": state.data_state, "accuracy_before": state.accuracy_before}
        )
    )
    (tmp / "config.yaml").write_text(to_yaml(cfg))
    (tmp / MARKER).write_text("ok\n")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run folder, or None."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return None
    done = [p for p in root.glob("step_*") if p.is_dir() and ".tmp-" not in p.name and (p / MARKER).is_file()]
    return max(done, key=lambda p: int(p.name.split("_")[1]), default=None)


def resolve_resume(cfg: RunConfig) -> Path | None:
    """The checkpoint `trainer.resume` asks for (None = start fresh)."""
    resume = cfg.trainer.resume
    if resume == "never":
        return None
    if resume == "auto":
        return latest_checkpoint(cfg.trainer.run_dir)
    path = Path(resume)
    if not (path / MARKER).is_file():
        raise ConfigError(
            f"trainer.resume={resume!r} is not a complete checkpoint (no {MARKER} marker). "
            f"Fix: point it at RUN_DIR/checkpoints/step_N, or use trainer.resume=auto."
        )
    return path


def load_checkpoint(group: Any, path: Path) -> TrainerState:
    """Restore the engines from `path` and return the trainer state saved with them."""
    raw = json.loads((path / "trainer_state.json").read_text())
    group.load(str(path / "engine"))
    return TrainerState(
        step=raw["step"], data_state=raw["data_state"], accuracy_before=raw.get("accuracy_before")
    )
