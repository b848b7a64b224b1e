"""Runs that survive a killed Ray actor (CPU, the session's Ray instance, a tiny model): kill -9 of
a rollout actor's pid (from RUN_DIR/actors.json) in the middle of step 2 replaces the actor and the
step goes on; kill -9 of a training actor restarts the run from step 1's checkpoint. Both end
exactly as the one-process run (metrics and final weights), and count their restart.

The kill comes from the run's own reward (kill_reward.py), at the first sample scored in step 2, so
it lands at the same point of every run. Each test prints the recovery time (from the kill to the
end of step 2) next to the uninterrupted run's step time (docs/benchmarks.md).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("ray", reason="needs the ray extra: pip install 'rlloom[ray]'")

from rlloom.config import load_config  # noqa: E402
from rlloom.observability.jsonl import JsonlLogger  # noqa: E402
from rlloom.trainer.checkpoint import checkpoint_dir, checkpoint_model_tensors  # noqa: E402
from rlloom.trainer.run import run  # noqa: E402

pytestmark = pytest.mark.usefixtures("ray_cluster")
SKIP = ("time/", "perf/", "sync/ms", "memory/", "cluster/")
STEPS = 2
SEPARATE = (
    "cluster.mode=ray",
    "cluster.placement=separate",
    "cluster.num_workers=1",
    "cluster.rollout_workers=1",
    "cluster.timeout_s=300",  # actors start slowly on a busy 2-core machine; a death is seen at once
)


def cfg_for(ckpt: Path, run_dir: Path, *extra: str, steps: int = STEPS):
    return load_config(
        "arithmetic_smoke",
        [
            f"model.path={ckpt}",
            f"trainer.run_dir={run_dir}",
            f"trainer.total_steps={steps}",
            "trainer.prompts_per_step=4",
            "trainer.save_every=1",
            "data.num_eval=4",
            "data.num_train=64",
            "rollout.max_new_tokens=5",
            "rollout.max_num_seqs=4",  # the prompts of a step are still in flight at the kill
            "logging.console=false",
            "train.lr=3e-2",  # the samples change from step to step: stale weights would show
            "trainer.num_mini_batches=2",
            "reward.name=kill_reward:digit_share_killing",
            f"reward.import_dir={Path(__file__).parent}",
            "reward.num_workers=1",
            *extra,
        ],
    )


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_same_run(a: Path, b: Path, steps: int = STEPS) -> None:
    ma, mb = metrics(a), metrics(b)
    assert [r["step"] for r in ma] == [r["step"] for r in mb] == list(range(steps + 1))
    for ra, rb in zip(ma, mb):
        ra, rb = ({k: v for k, v in r.items() if not k.startswith(SKIP)} for r in (ra, rb))
        assert ra.keys() == rb.keys(), ra.keys() ^ rb.keys()
        for k in ra:
            assert ra[k] == pytest.approx(rb[k], rel=1e-5, abs=1e-6), (ra["step"], k)
    wa, wb = (checkpoint_model_tensors(checkpoint_dir(x, steps)) for x in (a, b))
    assert wa.keys() == wb.keys()
    for k in wa:
        # Adam at lr 3e-2 turns the rounding of another summation order on Ray into ~1e-6 in a
        # few elements (test_cluster_ray.py); a rollout on stale or missing weights is off by far more.
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=5e-5, msg=lambda m, k=k: f"{k}: {m}")


@pytest.fixture
def step_times(monkeypatch) -> dict[int, float]:
    """Wall-clock time at which each step's metrics were logged."""
    times: dict[int, float] = {}
    log = JsonlLogger.log

    def timed(self, step, values):
        times[step] = time.time()
        log(self, step, values)

    monkeypatch.setattr(JsonlLogger, "log", timed)
    return times


@pytest.fixture(scope="module")
def inline(tiny_checkpoint, tmp_path_factory) -> Path:
    """The one-process run both kills are compared with."""
    run_dir = tmp_path_factory.mktemp("inline")
    run(cfg_for(tiny_checkpoint, run_dir))
    assert len({r["reward/mean"] for r in metrics(run_dir)[1:]}) > 1, "the samples should change"
    return run_dir


def kill(monkeypatch, run_dir: Path, *who: str) -> None:
    """Kill actor `who` ("rollout:0") at the first sample scored after step 1; a second one after step 2."""
    monkeypatch.setenv("KILL_ACTOR", ",".join(f"{w}:{step}" for step, w in enumerate(who, 1)))
    monkeypatch.setenv("KILL_ACTOR_DIR", str(run_dir))


def killed(run_dir: Path, who: str) -> tuple[float, int]:
    """When and which pid kill_reward.py killed for `who` ("rollout:0")."""
    at, pid = (run_dir / f"killed-{who.replace(':', '-')}").read_text().split()
    return float(at), int(pid)


def report(label: str, run_dir: Path, times: dict[int, float], who: str) -> None:
    killed_at, pid = killed(run_dir, who)
    step = min(s for s, t in times.items() if t > killed_at)
    print(
        f"\n{label}: kill -9 of pid {pid} -> step {step} done in {times[step] - killed_at:.1f} s", flush=True
    )


def test_a_killed_rollout_actor_is_replaced_and_the_run_equals_one_process(
    tiny_checkpoint, inline, tmp_path, monkeypatch, step_times
):
    kill(monkeypatch, tmp_path, "rollout:0")
    run(cfg_for(tiny_checkpoint, tmp_path, *SEPARATE))
    report("rollout restart", tmp_path, step_times, "rollout:0")
    actors = json.loads((tmp_path / "actors.json").read_text())
    assert {(a["role"], a["rank"]) for a in actors} == {("train", 0), ("rollout", 0)}
    assert killed(tmp_path, "rollout:0")[1] not in {a["pid"] for a in actors}  # rewritten with the new actor
    rows = metrics(tmp_path)
    assert [r.get("cluster/rollout_restarts") for r in rows] == [None, None, 1.0]
    assert all("cluster/train_restarts" not in r for r in rows)
    assert_same_run(inline, tmp_path)


def test_a_training_actor_killed_mid_step_and_during_a_save_restarts_from_the_newest_complete_checkpoint(
    tiny_checkpoint, inline, tmp_path, monkeypatch, step_times, capsys
):
    """kill -9 of the training actor in the middle of step 2, then (in the restarted run) in step 2's
    save, its engine state written into the temporary folder but not sealed by a manifest: each
    restart loads step 1's checkpoint, never the partial one, and the run ends as the uninterrupted
    one with no temporary folder left."""
    kill(monkeypatch, tmp_path / "run", "train:0")
    monkeypatch.setenv("RLLOOM_FAULT", f"save:{2 * STEPS}:0")  # policy version 4: two updates a step
    monkeypatch.setenv("RLLOOM_FAULT_ONCE", str(tmp_path / "fired"))
    run(cfg_for(tiny_checkpoint, tmp_path / "run", *SEPARATE))
    report("training restart", tmp_path / "run", step_times, "train:0")
    assert (tmp_path / "fired").exists()
    err = capsys.readouterr().err
    for n, stage in ((1, r"'\w+'"), (2, "'save'")):
        restart = rf"training restart {n} of .* failed in stage {stage}.* start again from \S+step_000001\n"
        assert re.search(restart, err), restart
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == [
        "step_000001",
        "step_000002",
    ]
    rows = metrics(tmp_path / "run")
    assert [r.get("cluster/train_restarts") for r in rows] == [None, None, 2.0]
    assert_same_run(inline, tmp_path / "run")


@pytest.mark.parametrize("mode", ["one_step_off", "async"])
def test_killed_rollout_and_training_actors_in_an_asynchronous_mode_restart_from_the_checkpoint(
    mode, tiny_checkpoint, tmp_path, monkeypatch, step_times
):
    """In the asynchronous modes the training weights move on while the rollout generates, so a dead
    rollout's requests are not sent again under newer weights: a rollout killed in step 2, like a
    training actor killed in step 3, restarts the run from its checkpoint (a scheduled checkpoint
    drains what is in flight), and the run equals the uninterrupted one: the prompts of every step
    (the samples' metrics) and the final weights."""
    args = (f"trainer.mode={mode}",)
    run(cfg_for(tiny_checkpoint, tmp_path / "inline", *args, steps=3))
    kill(monkeypatch, tmp_path / "ray", "rollout:0", "train:0")
    run(cfg_for(tiny_checkpoint, tmp_path / "ray", *SEPARATE, *args, steps=3))
    report(f"{mode} rollout kill", tmp_path / "ray", step_times, "rollout:0")
    report(f"{mode} training kill", tmp_path / "ray", step_times, "train:0")
    rows = metrics(tmp_path / "ray")
    assert [r.get("cluster/train_restarts") for r in rows] == [None, None, 1.0, 2.0]
    assert all("cluster/rollout_restarts" not in r for r in rows)
    assert_same_run(tmp_path / "inline", tmp_path / "ray", steps=3)
