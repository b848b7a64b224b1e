"""A Ray cluster that lost a node and has no room left for the layout stops the run at once, in one
line naming the failure, the lost node and how to continue (the real node stop:
test_cluster_nodes.py). Fast stand-ins: `ray.nodes()` is given, and the run's attempts raise."""

from __future__ import annotations

import pytest

pytest.importorskip("ray", reason="needs the ray extra: pip install 'rlloom[ray]'")

import rlloom.trainer.run as run_module  # noqa: E402
from rlloom.cli import main  # noqa: E402
from rlloom.cluster import NoRoom, WorkerFailure, ray_slots  # noqa: E402
from rlloom.cluster.ray_slots import Actors  # noqa: E402


def node(name: str, cpus: int, alive: bool = True) -> dict:
    return {"NodeID": name * 56, "NodeManagerAddress": "10.0.0.9", "Alive": alive, "Resources": {"CPU": cpus}}


def actors(monkeypatch, *nodes: dict) -> Actors:
    """An `Actors` of two one-slot node groups (one training, one rollout actor), on `nodes`."""
    monkeypatch.setattr(ray_slots.ray, "nodes", lambda: list(nodes))
    group = Actors.__new__(Actors)
    group.node_groups, group.use_gpu = [[0], [1]], False
    return group


def test_a_lost_node_that_leaves_no_room_is_named_and_one_that_leaves_room_is_not(monkeypatch):
    with pytest.raises(NoRoom, match=r"needs 2 slots .* alive nodes have 1 .*no longer alive: bbbbbbbb \(10"):
        actors(monkeypatch, node("a", 1), node("b", 1, alive=False)).check_room()
    actors(monkeypatch, node("a", 1), node("c", 1), node("b", 1, alive=False)).check_room()
    actors(monkeypatch, node("a", 1)).check_room()  # none lost: waited on (an autoscaler may add nodes)


def test_a_restart_without_room_stops_at_once_in_one_line(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    """The first failure restarts the run; the restart finds no room: no further attempt, one line
    with both causes and `trainer.resume=auto`, exit 1."""
    attempts: list[int] = []

    def failing(cfg, resume_from, restarts=0):
        attempts.append(restarts)
        if restarts == 0:
            raise WorkerFailure(
                "training rank 0 on 10.0.0.9 (pid 7) failed in stage 'generate': ActorDiedError"
            )
        raise NoRoom("the Ray cluster has no room for the run's layout (CPU slots): it needs 2 slots")

    monkeypatch.setattr(run_module, "_run", failing)
    code = main(["train", "arithmetic_smoke", f"model.path={tiny_checkpoint}", f"trainer.run_dir={tmp_path}"])
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("rlloom: ")]
    assert code == 1 and attempts == [0, 1]
    assert lines == [
        "rlloom: worker failure: training rank 0 on 10.0.0.9 (pid 7) failed in stage 'generate': ActorDiedError, "
        "and the Ray cluster has no room for the run's layout (CPU slots): it needs 2 slots. The run stopped "
        "after 1 restarts (trainer.max_restarts=3); restart with trainer.resume=auto to continue from the last "
        "checkpoint."
    ]
