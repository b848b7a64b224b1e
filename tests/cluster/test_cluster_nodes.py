"""A real Ray cluster of three nodes on one machine: a head and two nodes started with `ray start`
(each with one CPU slot of its own and a resource label), joined by `cluster.address`. A run with
one training and one rollout actor has to use two nodes; it equals the one-process run, and
actors.json names both. Stopping a node mid-run (`ray stop` on it: SIGTERM to its `ray start
--block`, which stops what it started) loses its actor: the run goes on where the layout still fits
(a node to spare), else stops in one line. The nodes left are stopped in teardown the same way."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

pytest.importorskip("ray", reason="needs the ray extra: pip install 'rlloom[ray]'")

from rlloom.config import load_config  # noqa: E402
from rlloom.trainer.checkpoint import checkpoint_dir, checkpoint_model_tensors  # noqa: E402
from rlloom.trainer.run import run  # noqa: E402

STEPS = 2
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled"}
"""The nodes and the driver agree on no token: a head started by `ray start` asks for one by
default, which a second node of the same machine does not send unless told."""
SKIP = ("time/", "perf/", "sync/ms", "memory/", "cluster/")
ARGS = (
    "trainer.total_steps=2",
    "trainer.prompts_per_step=4",
    "data.num_eval=4",
    "data.num_train=64",
    "rollout.max_new_tokens=5",
    "logging.console=false",
    "train.lr=3e-2",
    "reward.name=kill_reward:digit_share_killing",  # the share of digits; holds a run as HOLD_DIR says
    f"reward.import_dir={Path(__file__).parent}",
    "reward.num_workers=1",
)


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def ray_start(log: Path, *args: str, attempts: int = 3) -> subprocess.Popen:
    """`ray start --block` with one CPU and its own ports; returns once the node is up. Ray gives a
    raylet 30 s to register, which a busy 2-core machine can miss: a node that gave up is started
    again (its session killed first)."""
    manager, objects, metrics, agent, agent_grpc, env_agent = free_ports(6)
    cmd = [
        str(Path(sys.executable).parent / "ray"),
        "start",
        "--block",
        "--num-cpus=1",
        "--disable-usage-stats",
        f"--node-manager-port={manager}",
        f"--object-manager-port={objects}",
        f"--metrics-export-port={metrics}",
        f"--dashboard-agent-listen-port={agent}",
        f"--dashboard-agent-grpc-port={agent_grpc}",
        f"--runtime-env-agent-port={env_agent}",
        *args,
    ]
    with log.open("w") as out:
        node = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=ENV)
    deadline = time.monotonic() + 180
    while "Ray runtime started" not in log.read_text():
        exited = node.poll() is not None
        if exited and "timed out during startup" in log.read_text() and attempts > 1:
            with contextlib.suppress(ProcessLookupError):  # the raylet it left, in the session started for it
                os.killpg(node.pid, signal.SIGKILL)
            return ray_start(log, *args, attempts=attempts - 1)
        assert not exited and time.monotonic() < deadline, log.read_text()[-2000:]
        time.sleep(0.5)
    return node


@dataclass
class Nodes:
    """The module's cluster: its address and the `ray start --block` process of each node, by label."""

    address: str
    procs: dict[str, subprocess.Popen]
    logs: Path

    def add(self, label: str) -> None:
        """Start one more node (one CPU slot, resource `label`) in the cluster."""
        args = (f"--address={self.address}", f'--resources={{"{label}": 1}}')
        self.procs[label] = ray_start(self.logs / f"{label}.log", *args)

    def stop(self, label: str) -> None:
        """`ray stop` on that node alone: SIGTERM to each of its processes (its `ray start --block`
        stops the raylet and the rest it started), then SIGKILL to what is left (its workers)."""
        node = self.procs[label]
        family = descendants(node.pid)
        for pid in [node.pid, *family]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            node.wait(60)
        kill(node, family)

    def label_of(self, pid: int) -> str:
        """The node whose processes include `pid` (an actor: a child of its node's raylet)."""
        by_pid = {p.pid: label for label, p in self.procs.items()}
        while pid > 1 and pid not in by_pid:
            pid = parent(pid)
        return by_pid[pid]


def kill(node: subprocess.Popen, family: list[int]) -> None:
    """SIGKILL to a node's session (started for it) and to `family`, its processes (its workers)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(node.pid, signal.SIGKILL)
    for pid in family:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    node.wait()


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def descendants(root: int) -> list[int]:
    """The processes below `root` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                children.setdefault(parent(int(entry.name)), []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


@pytest.fixture(scope="module")
def ray_nodes(tmp_path_factory) -> Nodes:
    """A head node (label `head`) and two more nodes (labels `second`, `third`), one CPU slot each."""
    import ray

    logs = tmp_path_factory.mktemp("nodes")
    temp_dir = tempfile.mkdtemp(prefix="rn", dir="/tmp")  # short: Ray's socket paths have a length limit
    (port,) = free_ports(1)
    ip = ray.util.get_node_ip_address()
    nodes = Nodes(f"{ip}:{port}", {}, logs)
    try:
        nodes.procs["head"] = ray_start(
            logs / "head.log",
            "--head",
            f"--port={port}",
            "--include-dashboard=false",
            f"--temp-dir={temp_dir}",
            '--resources={"head": 1}',
        )
        nodes.add("second")
        nodes.add("third")  # room to lose one node: started here, before the runs load the machine
        yield nodes
    finally:  # no run is left to see the nodes go: killed at once, not stopped gracefully (~10 s each)
        for node in nodes.procs.values():
            kill(node, descendants(node.pid))
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def inline(tiny_checkpoint, tmp_path_factory) -> Path:
    """The one-process run the runs over nodes are compared with."""
    run_dir = tmp_path_factory.mktemp("inline")
    run(
        load_config(
            "arithmetic_smoke", [f"model.path={tiny_checkpoint}", f"trainer.run_dir={run_dir}", *ARGS]
        )
    )
    return run_dir


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def metrics(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(SKIP)} for r in rows(run_dir)]


def assert_same_run(a: Path, b: Path) -> None:
    ma, mb = metrics(a), metrics(b)
    assert [r["step"] for r in ma] == [r["step"] for r in mb] == list(range(STEPS + 1))
    for ra, rb in zip(ma, mb):
        assert ra.keys() == rb.keys()
        for k in ra:
            assert ra[k] == pytest.approx(rb[k], rel=1e-5, abs=1e-6), (ra["step"], k)
    wa, wb = (checkpoint_model_tensors(checkpoint_dir(x, STEPS)) for x in (a, b))
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=5e-5, msg=lambda m, k=k: f"{k}: {m}")


def train_cmd(ckpt: Path, run_dir: Path, address: str, *extra: str) -> list[str]:
    cmd = [sys.executable, "-m", "rlloom.cli", "train", "arithmetic_smoke", f"model.path={ckpt}"]
    cmd += [f"trainer.run_dir={run_dir}", *ARGS, "cluster.mode=ray", f"cluster.address={address}"]
    return cmd + ["cluster.placement=separate", "cluster.num_workers=1", "cluster.rollout_workers=1", *extra]


def test_a_run_over_two_nodes_equals_the_one_process_run(tiny_checkpoint, ray_nodes, inline, tmp_path):
    nodes = tmp_path / "nodes"
    cmd = train_cmd(tiny_checkpoint, nodes, ray_nodes.address)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]

    actors = json.loads((nodes / "actors.json").read_text())
    assert sorted((a["role"], a["rank"]) for a in actors) == [("rollout", 0), ("train", 0)]
    assert len({a["node_id"] for a in actors}) == 2, actors  # one slot per node: both are used
    assert all(a["device"] == "cpu" and a["pid"] > 0 and a["node_ip"] for a in actors)
    assert_same_run(inline, nodes)


def run_stopping_a_node(nodes: Nodes, cmd: list[str], run_dir: Path) -> tuple[int, str, str, float]:
    """Run `cmd`, held in step 2 (kill_reward.py) while a node (never the head) holding one of its
    actors is stopped. Returns the exit code, stderr, the role lost and the time of the stop."""
    run_dir.mkdir()
    with (run_dir.parent / f"{run_dir.name}.err").open("w+") as err:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=err, env={**ENV, "HOLD_DIR": str(run_dir)}
        )
        deadline = time.monotonic() + 400
        while not (run_dir / "held").exists():
            assert proc.poll() is None and time.monotonic() < deadline, Path(err.name).read_text()[-3000:]
            time.sleep(0.2)
        actors = json.loads((run_dir / "actors.json").read_text())
        role, label = next(
            (a["role"], nodes.label_of(a["pid"])) for a in actors if nodes.label_of(a["pid"]) != "head"
        )
        stopped = time.monotonic()
        nodes.stop(label)
        del nodes.procs[label]
        (run_dir / "go").write_text("")
        proc.wait(600)
        err.seek(0)
        return proc.returncode, err.read(), role, stopped


def test_stopping_a_node_mid_run_goes_on_where_the_layout_fits_else_stops_in_one_line(
    tiny_checkpoint, ray_nodes, inline, tmp_path
):
    """`ray stop` of a node holding an actor in step 2 (the run held there while it stops). With the third node the layout
    still fits: the lost rollout actor is replaced, or the run restarts from its checkpoint, on the nodes
    left, and the run equals the one-process run. Then, with the head and one node left, stopping
    that node leaves no room: the run stops at once (not at cluster.timeout_s) with one line naming
    the lost actor and node and how to continue."""
    cmd = train_cmd(tiny_checkpoint, tmp_path / "fits", ray_nodes.address, "trainer.save_every=1")
    code, err, role, stopped = run_stopping_a_node(ray_nodes, cmd, tmp_path / "fits")
    assert code == 0, err[-3000:]
    print(f"\nnode stop ({role} lost): run done {time.monotonic() - stopped:.1f} s after", flush=True)
    restarts = {
        k: max(r.get(k, 0) for r in rows(tmp_path / "fits"))
        for k in ("cluster/train_restarts", "cluster/rollout_restarts")
    }
    assert restarts == {
        "cluster/train_restarts": float(role == "train"),
        "cluster/rollout_restarts": float(role == "rollout"),
    }
    assert_same_run(inline, tmp_path / "fits")

    cmd = train_cmd(tiny_checkpoint, tmp_path / "short", ray_nodes.address, "cluster.timeout_s=300")
    code, err, role, stopped = run_stopping_a_node(ray_nodes, cmd, tmp_path / "short")
    assert time.monotonic() - stopped < 120, "the lost room should be seen at once"
    lines = [x for x in err.splitlines() if x.startswith("rlloom: ")]
    assert code == 1 and len(lines) == 1, err[-3000:]
    assert re.fullmatch(
        rf"rlloom: worker failure: {'training' if role == 'train' else 'rollout'} rank 0 on .* failed in stage .*"
        r"no room for the run's layout \(CPU slots\): it needs 2 slots .* its alive nodes have 1 .*"
        r"nodes no longer alive: .*add a node to the cluster .*restart with trainer.resume=auto.*",
        lines[0],
    ), lines[0]
