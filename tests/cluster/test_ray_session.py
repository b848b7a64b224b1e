"""A run's training restarts keep the Ray instance the run started (`ray_slots.ray_session`): a
restart replaces the actors, and starting Ray again would cost seconds and, on a busy machine, fail
with Ray's traceback. Fast stand-ins for Ray's start and stop and for the actors' placement; the
CLI's run, its restart loop and `Actors`' start and close are the real ones."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("ray", reason="needs the ray extra: pip install 'rlloom[ray]'")

import rlloom.trainer.run as run_module  # noqa: E402
from rlloom.cli import main  # noqa: E402
from rlloom.cluster import WorkerFailure, ray_slots  # noqa: E402
from rlloom.cluster.placement import plan_placement  # noqa: E402
from rlloom.cluster.ray_slots import Actors  # noqa: E402


def test_a_restarted_run_keeps_the_ray_instance_it_started(tiny_checkpoint, tmp_path, monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(ray_slots.ray, "is_initialized", lambda: calls[-1:] == ["init"])
    monkeypatch.setattr(ray_slots.ray, "init", lambda **kwargs: calls.append("init"))
    monkeypatch.setattr(ray_slots.ray, "shutdown", lambda: calls.append("shutdown"))
    monkeypatch.setattr(Actors, "_place", lambda self, cfg, placement: None)
    attempts: list[int] = []

    def attempt(cfg, resume_from, restarts=0):
        """Each attempt starts and closes the actors as `_run` does; the first two lose a worker."""
        Actors(cfg, plan_placement(cfg)).close()
        attempts.append(restarts)
        if restarts < 2:
            raise WorkerFailure(
                "training rank 0 on 10.0.0.9 (pid 7) failed in stage 'generate': ActorDiedError"
            )
        return run_module.RunResult(
            steps=2, seconds=1.0, accuracy_before=None, accuracy_after=None, run_dir=Path(cfg.trainer.run_dir)
        )

    monkeypatch.setattr(run_module, "_run", attempt)
    args = ["train", "arithmetic_smoke", f"model.path={tiny_checkpoint}", f"trainer.run_dir={tmp_path}"]
    assert main([*args, "cluster.mode=ray"]) == 0
    assert attempts == [0, 1, 2]
    assert calls == ["init", "shutdown"]  # once for the run, not once an attempt
