"""Reward code cannot stop the trainer: plug-ins run in worker processes by default, where a hang,
an exit, a crash, a child process, a memory hog or an out-of-range score costs one sample's score."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from reward_fns_for_tests import echo_score

from rlloom.cli import main as cli_main
from rlloom.config import ConfigError, RewardConfig, load_config
from rlloom.rewards.build import build_reward_runner
from rlloom.trainer.run import run

PLUGIN = "reward_fns_for_tests:misbehave"


def test_plugin_reward_is_isolated_by_default_and_every_failure_is_counted():
    runner = build_reward_runner(
        RewardConfig(name=PLUGIN, timeout_s=1.0, default_score=-1.0), task="arithmetic"
    )
    pairs = [
        ("hang", "0"),  # first of a chunk: the samples queued behind it are scored elsewhere
        ("good", "2"),
        ("exit", "0"),
        ("crash", "0"),
        ("raise", "0"),
        ("big", "0"),
        ("huge", "0"),
        ("nan", "0"),
        ("abc", "0"),
        ("good", "-3.0e38"),  # a float32, but its group's std overflowed: invalid
        ("good", "-1e15"),  # the largest magnitude accepted
    ]
    with runner:
        assert runner.num_workers == 2
        start = time.monotonic()
        result = runner.score(pairs)
        elapsed = time.monotonic() - start
        assert result.scores == [-1.0, 2.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1e15]
        assert result.metrics() == {"reward/timeouts": 1.0, "reward/errors": 3.0, "reward/invalid": 5.0}
        assert elapsed < 6.0, f"score() took {elapsed:.2f}s with a 1s timeout"
        again = runner.score([("good", str(i)) for i in range(40)])  # the pool recovered
        assert again.scores == [float(i) for i in range(40)] and again.metrics()["reward/errors"] == 0


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")  # a zombie has exited; only its parent has not read its status yet


def test_timeout_kills_the_processes_a_reward_started(tmp_path):
    pid_file = tmp_path / "child.pid"
    with build_reward_runner(RewardConfig(name=PLUGIN, timeout_s=1.0), task="arithmetic") as runner:
        result = runner.score([("child", str(pid_file))])
        assert result.scores == [0.0] and result.num_timeouts == 1
        pid = int(pid_file.read_text())
        try:
            deadline = time.monotonic() + 2.0
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not _alive(pid), "the reward's child process outlived its killed worker"
        finally:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _wait_gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


def test_a_setsid_daemon_a_reward_started_ends_with_the_run_and_never_holds_its_stdout(
    tiny_checkpoint, tmp_path
):
    """`rlloom train ... | cat`: a reward that double-forks a daemon into a session of its own,
    holding the worker's stdout. Before, the run ended but `cat` waited on the daemon (it held the
    trainer's stdout, which workers inherited), and the daemon lived on after the run."""
    pid_file = tmp_path / "daemon.pid"
    cmd = [sys.executable, "-m", "rlloom.cli", "train", "arithmetic_smoke", f"model.path={tiny_checkpoint}"]
    cmd += [f"trainer.run_dir={tmp_path / 'run'}", "trainer.total_steps=1", "data.num_train=16"]
    cmd += ["data.num_eval=2", "rollout.max_new_tokens=3", "reward.name=reward_fns_for_tests:start_daemon"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), DAEMON_PID_FILE=str(pid_file))
    with (tmp_path / "stderr.txt").open("wb") as err:
        trainer = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=env, cwd=tmp_path)
    output: list[bytes] = []
    reader = threading.Thread(target=lambda: output.append(trainer.stdout.read()))  # what `cat` does
    reader.start()
    try:
        assert trainer.wait(timeout=300) == 0, (tmp_path / "stderr.txt").read_text()[-3000:]
        reader.join(timeout=10.0)
        assert not reader.is_alive(), "the trainer's stdout stayed open after the run ended"
        assert b"accuracy_after" in output[0]
        pid = int(pid_file.read_text())
        assert _wait_gone(pid, 2.0), "the reward's daemon outlived the run"
    finally:
        if pid_file.is_file() and pid_file.read_text().strip() and _alive(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        trainer.kill()
        reader.join(timeout=5.0)
        trainer.stdout.close()


def test_workers_die_with_a_killed_trainer(tmp_path):
    daemon_pid = tmp_path / "daemon.pid"
    script = (
        "from reward_fns_for_tests import misbehave, start_daemon; from rlloom.rewards import RewardRunner;"
        "RewardRunner(start_daemon, num_workers=1).score([('x', '0')]);"  # a daemon left running
        "runner = RewardRunner(misbehave, num_workers=1, timeout_s=3600);"
        "print(runner._workers[0].popen.pid, flush=True); runner.score([('hang', '0')])"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), DAEMON_PID_FILE=str(daemon_pid))
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env)
    pid = int(trainer.stdout.readline())
    daemon = int(daemon_pid.read_text())
    try:
        time.sleep(0.5)  # the worker is scoring its hanging sample
        trainer.kill()  # SIGKILL: the trainer runs no cleanup
        trainer.wait()
        assert _wait_gone(pid, 3.0), "a reward worker outlived its killed trainer"
        assert _wait_gone(daemon, 3.0), "a reward's daemon outlived the killed trainer"
    finally:
        trainer.stdout.close()
        for p in (pid, daemon):
            if _alive(p):
                os.kill(p, signal.SIGKILL)


def test_memory_limit_caps_a_worker():
    capped = RewardConfig(name=PLUGIN, memory_limit_gb=0.25, num_workers=1)
    with build_reward_runner(capped, task="arithmetic") as runner:
        result = runner.score([("hog", "0"), ("good", "2")])
    assert result.scores == [0.0, 2.0] and result.num_errors == 1  # MemoryError in the worker
    with build_reward_runner(
        RewardConfig(name=PLUGIN, memory_limit_gb=0, num_workers=1), task="arithmetic"
    ) as runner:
        assert runner.score([("hog", "0")]).scores == [1.0]  # the same function, uncapped


def test_builtins_run_inline_unless_asked():
    assert build_reward_runner(RewardConfig(), task="arithmetic").num_workers == 0
    assert build_reward_runner(RewardConfig(name="math + 0.1*format_boxed"), task="jsonl").num_workers == 0
    mixed = RewardConfig(name="reward_fns_for_tests:length_bonus + 0.5*format_number", num_workers=1)
    with build_reward_runner(mixed, task="arithmetic") as runner:
        assert runner.num_workers == 1 and runner.score([("7", "")]).scores == [1.5]
    with build_reward_runner(
        RewardConfig(builtins_in_workers=True, num_workers=1), task="arithmetic"
    ) as runner:
        assert runner.num_workers == 1 and runner.score([("12 + 35 = 47", "47")]).scores == [1.0]


@pytest.mark.parametrize(
    "override, message",
    [
        ("reward.timeout_s=.inf", "reward.timeout_s=inf is invalid"),
        ("reward.timeout_s=0", "reward.timeout_s=0"),
        ("reward.timeout_s=-1", "reward.timeout_s=-1"),
        ("reward.num_workers=0", "reward.num_workers=0"),
        ("reward.memory_limit_gb=-1", "reward.memory_limit_gb=-1"),
        ("reward.default_score=1e39", "reward.default_score=1e+39"),
    ],
)
def test_bad_reward_settings_are_rejected_at_start_up(override, message, capsys):
    with pytest.raises(ConfigError, match=message.replace("+", r"\+")):
        load_config("arithmetic_smoke", [override])
    assert cli_main(["train", "arithmetic_smoke", override]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlloom: error: ") and message in err and err.count("\n") == 1


def test_run_completes_when_a_plugin_reward_hangs_on_some_samples(tiny_checkpoint, tmp_path):
    cfg = load_config(
        "arithmetic_smoke",
        [
            f"model.path={tiny_checkpoint}",
            f"trainer.run_dir={tmp_path}",
            "trainer.total_steps=1",
            "data.num_eval=2",
            "data.num_train=16",
            "rollout.max_new_tokens=3",
            "logging.console=false",
            "reward.name=reward_fns_for_tests:hang_on_even_answers",
            "reward.timeout_s=0.3",
            "reward.num_workers=4",
        ],
    )
    assert run(cfg).steps == 1
    step = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()][1]
    hung = step["reward/timeouts"]
    assert hung in (4.0, 8.0) and step["reward/mean"] == pytest.approx((8 - hung) / 8)  # 2 prompts x 4
    assert (tmp_path / "checkpoints" / "step_000001" / "manifest.json").is_file()


def test_plain_plugin_still_scores_in_order():
    with build_reward_runner(
        RewardConfig(name="reward_fns_for_tests:echo_score"), task="arithmetic"
    ) as runner:
        assert runner.fn is echo_score
        assert runner.score([("ok", str(i)) for i in range(50)]).scores == [float(i) for i in range(50)]
