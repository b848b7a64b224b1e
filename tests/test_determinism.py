"""trainer.deterministic reaches every process of a run: the controller (and the inline workers in
it) and each Ray slot actor, with cuBLAS's workspace setting in the actor's environment. The GPU
runs it is for are in tests/gpu/test_deterministic_gpu.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "trainer"))
from test_trainer_loop import read_metrics, tiny_cfg  # noqa: E402

from rlloom.trainer.run import run  # noqa: E402


def _settings() -> tuple[bool, str | None, bool, bool]:
    """What deterministic mode sets in a process."""
    return (
        torch.are_deterministic_algorithms_enabled(),
        os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        torch.backends.cudnn.deterministic,
    )


ON = (True, ":4096:8", False, True)


def test_inline_run_is_deterministic_and_repeats(tiny_checkpoint, tmp_path, restore_determinism):
    os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    torch.use_deterministic_algorithms(False)
    extra = ("trainer.total_steps=2", "trainer.deterministic=true")
    run(tiny_cfg(tiny_checkpoint, tmp_path / "a", *extra))
    assert _settings() == ON  # the controller's process, where the inline workers run
    run(tiny_cfg(tiny_checkpoint, tmp_path / "b", *extra))
    assert read_metrics(tmp_path / "a") == read_metrics(tmp_path / "b")


def test_default_run_leaves_torch_as_it_is(tiny_checkpoint, tmp_path, restore_determinism):
    torch.use_deterministic_algorithms(False)
    run(tiny_cfg(tiny_checkpoint, tmp_path / "run", "trainer.total_steps=1"))
    assert not torch.are_deterministic_algorithms_enabled()


def test_every_ray_actor_is_deterministic(ray_cluster, tiny_checkpoint, tmp_path):
    ray = pytest.importorskip("ray")
    from rlloom.cluster.build import build_groups

    cfg = tiny_cfg(
        tiny_checkpoint,
        tmp_path / "run",
        "cluster.mode=ray",
        "cluster.placement=separate",
        "cluster.num_workers=1",  # a training and a rollout actor: each role (the setting is rank-blind)
        "cluster.rollout_workers=1",
        "trainer.deterministic=true",
    )

    def report(actor) -> tuple[bool, str | None, bool, bool]:  # runs in the actor (nested: pickled by value)
        import os

        import torch

        return (
            torch.are_deterministic_algorithms_enabled(),
            os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
            torch.backends.cudnn.deterministic,
        )

    groups = build_groups(cfg)
    try:
        slots = groups.train.actors.slots
        reports = ray.get([s.__ray_call__.remote(report) for s in slots])
    finally:
        groups.close()
    assert len(reports) == 2 and all(r == ON for r in reports)


@pytest.mark.parametrize(
    ("extra", "warned"),
    [
        ([], False),
        (["trainer.mode=async"], True),
        (["algorithm.dynamic_sampling=true"], True),
        (["trainer.mode=one_step_off"], False),
    ],
)
def test_a_timing_dependent_rollout_is_named(tiny_checkpoint, tmp_path, extra, warned):
    from rlloom.determinism import timing_caveat

    cfg = tiny_cfg(tiny_checkpoint, tmp_path, "trainer.deterministic=true", *extra)
    assert (timing_caveat(cfg) is not None) == warned
    off = tiny_cfg(tiny_checkpoint, tmp_path, *extra)
    assert timing_caveat(off) is None
