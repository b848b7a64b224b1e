"""A real two-node Ray cluster on one machine: a head and a second node started with `ray start`
(each with one CPU slot of its own and a resource label), joined by `cluster.address`. A run with
one training and one rollout actor has to use both nodes; it equals the one-process run, and
actors.json names both nodes. The nodes are stopped in teardown (SIGTERM to the `ray start
--block` processes this module started, which stop what they started)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
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
SKIP = ("time/", "perf/", "sync/ms", "memory/")
ARGS = (
    "trainer.total_steps=2",
    "trainer.prompts_per_step=4",
    "data.num_eval=4",
    "data.num_train=64",
    "rollout.max_new_tokens=5",
    "logging.console=false",
    "train.lr=3e-2",
    "reward.name=resume_reward:digit_share",
    f"reward.import_dir={Path(__file__).parents[1] / 'trainer'}",
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


def ray_start(log: Path, *args: str) -> subprocess.Popen:
    """`ray start --block` with one CPU and its own ports; returns once the node is up."""
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
        assert node.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
        time.sleep(0.5)
    return node


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory) -> str:
    """The address of a head node (label `head`) and a second node (label `second`)."""
    import ray

    logs = tmp_path_factory.mktemp("nodes")
    temp_dir = tempfile.mkdtemp(prefix="rn", dir="/tmp")  # short: Ray's socket paths have a length limit
    (port,) = free_ports(1)
    ip = ray.util.get_node_ip_address()
    nodes = []
    try:
        nodes.append(
            ray_start(
                logs / "head.log",
                "--head",
                f"--port={port}",
                "--include-dashboard=false",
                f"--temp-dir={temp_dir}",
                '--resources={"head": 1}',
            )
        )
        nodes.append(ray_start(logs / "second.log", f"--address={ip}:{port}", '--resources={"second": 1}'))
        yield f"{ip}:{port}"
    finally:
        for node in reversed(nodes):
            node.send_signal(signal.SIGTERM)
            try:
                node.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(node.pid, signal.SIGKILL)  # the session this module started for it
        shutil.rmtree(temp_dir, ignore_errors=True)


def metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(SKIP)} for r in rows]


def test_a_run_over_two_nodes_equals_the_one_process_run(tiny_checkpoint, two_nodes, tmp_path):
    inline = tmp_path / "inline"
    run(
        load_config("arithmetic_smoke", [f"model.path={tiny_checkpoint}", f"trainer.run_dir={inline}", *ARGS])
    )
    nodes = tmp_path / "nodes"
    cmd = [sys.executable, "-m", "rlloom.cli", "train", "arithmetic_smoke", f"model.path={tiny_checkpoint}"]
    cmd += [f"trainer.run_dir={nodes}", *ARGS, "cluster.mode=ray", f"cluster.address={two_nodes}"]
    cmd += ["cluster.placement=separate", "cluster.num_workers=1", "cluster.rollout_workers=1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]

    actors = json.loads((nodes / "actors.json").read_text())
    assert sorted((a["role"], a["rank"]) for a in actors) == [("rollout", 0), ("train", 0)]
    assert len({a["node_id"] for a in actors}) == 2, actors  # one slot per node: both are used
    assert all(a["device"] == "cpu" and a["pid"] > 0 and a["node_ip"] for a in actors)

    ma, mb = metrics(inline), metrics(nodes)
    assert [r["step"] for r in ma] == [r["step"] for r in mb] == list(range(STEPS + 1))
    for ra, rb in zip(ma, mb):
        assert ra.keys() == rb.keys()
        for k in ra:
            assert ra[k] == pytest.approx(rb[k], rel=1e-5, abs=1e-6), (ra["step"], k)
    wa, wb = (checkpoint_model_tensors(checkpoint_dir(x, STEPS)) for x in (inline, nodes))
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=5e-5, msg=lambda m, k=k: f"{k}: {m}")
