"""Run checkpoints can neither be lost nor mixed: a full disk mid-save, a damaged newest checkpoint
(resume=auto falls back, saying so), stale temporary folders, keep_last_checkpoints, an interrupted
re-save of a step, the run-directory lock (live holder refused by pid and host, dead one taken over),
and resume=never on a folder that holds a run."""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from test_trainer_loop import tiny_cfg

from rlloom.cli import main
from rlloom.cluster.base import Done
from rlloom.config import ConfigError
from rlloom.engines.train.native import checkpoint as native_checkpoint
from rlloom.engines.train.sealed import CheckpointError, write_manifest
from rlloom.trainer import checkpoint as run_checkpoint
from rlloom.trainer.checkpoint import (
    TrainerState,
    checkpoint_model_tensors,
    latest_checkpoint,
    prepare_run_dir,
    save_checkpoint,
)
from rlloom.trainer.run import run
from rlloom.trainer.run_lock import RunDirLock


@pytest.fixture
def rlloom_log(caplog):
    logger = logging.getLogger("rlloom")  # does not propagate to the root logger caplog listens on
    logger.addHandler(caplog.handler)
    caplog.handler.setLevel(logging.INFO)
    yield caplog
    logger.removeHandler(caplog.handler)


def steps(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


def test_full_disk_then_damaged_checkpoint_then_resume(tiny_checkpoint, tmp_path, monkeypatch, rlloom_log):
    run_dir = tmp_path / "run"
    common = [
        "trainer.total_steps=3",
        "trainer.save_every=1",
        "trainer.keep_last_checkpoints=2",
        "data.num_eval=0",
    ]
    real_save_file, calls = native_checkpoint.save_file, []

    def disk_full_at_third_save(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save_file(*args, **kwargs)

    monkeypatch.setattr(native_checkpoint, "save_file", disk_full_at_third_save)
    with pytest.raises(
        CheckpointError, match=r"step 3 was not saved .*No space left.*step_000002, is intact"
    ) as err:
        run(tiny_cfg(tiny_checkpoint, run_dir, *common))
    assert "\n" not in str(err.value) and str(err.value).count("Fix:") == 1
    monkeypatch.undo()
    assert steps(run_dir) == ["step_000001", "step_000002"]  # no temporary folder left behind

    # The newest checkpoint gets flipped bytes in its weights; an interrupted save leaves a temp folder.
    weights = run_dir / "checkpoints" / "step_000002" / "engine" / "tensors_rank0.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    (run_dir / "checkpoints" / "step_000003.tmp-999999" / "engine").mkdir(parents=True)

    result = run(tiny_cfg(tiny_checkpoint, run_dir, *common, "trainer.resume=auto"))
    assert result.steps == 3
    log = rlloom_log.text
    assert "skipping checkpoint step_000002" in log
    assert "step_000002/engine' is damaged or was tampered with: file 'tensors_rank0.safetensors'" in log
    assert "step_000001 at step 1" in log
    assert "removed the interrupted save step_000003.tmp-999999" in log
    assert steps(run_dir) == ["step_000002", "step_000003"]  # step 2 saved anew, step 1 pruned
    assert latest_checkpoint(run_dir).name == "step_000003"
    assert len(checkpoint_model_tensors(run_dir / "checkpoints" / "step_000002")) > 0

    # The folder now holds a run: starting another one there with resume=never is refused.
    with pytest.raises(ConfigError, match="trainer.resume=auto.*another trainer.run_dir.*delete the folder"):
        run(tiny_cfg(tiny_checkpoint, run_dir, *common))


class FakeGroup:
    """Saves a tiny sealed engine folder holding `self.value`."""

    value = "a"

    def save(self, path: str) -> Done[None]:
        Path(path).mkdir()
        (Path(path) / "weights.txt").write_text(self.value)
        write_manifest(Path(path))
        return Done(None)


def test_interrupted_resave_of_a_step_keeps_a_complete_copy(tmp_path, monkeypatch):
    cfg = tiny_cfg(Path("unused"), tmp_path, "trainer.keep_last_checkpoints=1")
    group = FakeGroup()
    state = TrainerState(step=4, data_state={})
    save_checkpoint(group, cfg, state, weights_only=False)
    weights = tmp_path / "checkpoints" / "step_000004" / "engine" / "weights.txt"

    # Every rename and delete of the swap checks that a complete copy exists, under its name or .old;
    # the kill (an exception) hits between moving the old copy aside and renaming the new one in.
    real_replace, seen = os.replace, []

    def replace_then_die(src, dst):
        assert latest_checkpoint(tmp_path) or (tmp_path / "checkpoints" / "step_000004.old").is_dir()
        seen.append(Path(dst).name)
        if Path(dst).name == "step_000004":
            raise KeyboardInterrupt  # killed here
        real_replace(src, dst)

    monkeypatch.setattr(run_checkpoint.os, "replace", replace_then_die)
    group.value = "b"
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(group, cfg, state, weights_only=False)
    monkeypatch.undo()
    assert seen == ["step_000004.old", "step_000004"]
    prepare_run_dir(tmp_path)  # the next run's start-up finishes the swap
    assert latest_checkpoint(tmp_path).name == "step_000004" and weights.read_text() == "a"
    assert steps(tmp_path) == ["step_000004"]
    save_checkpoint(group, cfg, state, weights_only=False)  # an uninterrupted re-save replaces it
    assert weights.read_text() == "b" and steps(tmp_path) == ["step_000004"]


def test_keep_last_checkpoints_and_explicit_resume_of_a_damaged_one(tmp_path):
    cfg = tiny_cfg(Path("unused"), tmp_path, "trainer.keep_last_checkpoints=2")
    for step in (1, 2, 3, 4):
        save_checkpoint(FakeGroup(), cfg, TrainerState(step=step, data_state={}), weights_only=False)
    assert steps(tmp_path) == ["step_000003", "step_000004"]
    (tmp_path / "checkpoints" / "step_000004" / "trainer_state.json").write_text('{"step": 40}')
    resume = tmp_path / "checkpoints" / "step_000004"
    with pytest.raises(ConfigError, match="not a complete checkpoint.*'trainer_state.json'"):
        run(tiny_cfg(Path("unused"), tmp_path, f"trainer.resume={resume}"))
    with pytest.raises(ValueError, match="trainer.keep_last_checkpoints=-1 is invalid"):
        tiny_cfg(Path("unused"), tmp_path, "trainer.keep_last_checkpoints=-1")


HOLD = """
import sys, time
from rlloom.trainer.run_lock import RunDirLock
lock = RunDirLock(sys.argv[1]); lock.acquire()
print("locked", flush=True)
time.sleep(120)
"""


def test_run_dir_lock(tiny_checkpoint, tmp_path, rlloom_log, capsys):
    run_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        who = f"pid {holder.pid} on host {socket.gethostname()!r}"
        with pytest.raises(ConfigError, match=f"is in use by another run \\({who}"):
            run(tiny_cfg(tiny_checkpoint, run_dir))
        code = main(
            ["train", "arithmetic_smoke", f"trainer.run_dir={run_dir}", f"model.path={tiny_checkpoint}"]
        )
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("rlloom: error: ") and who in err and err.count("\n") == 1
    finally:
        holder.kill()  # dies holding the lock: the kernel drops it, the file still names the holder
        holder.wait()
    assert json.loads((run_dir / ".lock").read_text())["pid"] == holder.pid
    with RunDirLock(run_dir):
        assert json.loads((run_dir / ".lock").read_text())["pid"] == os.getpid()
        with pytest.raises(ConfigError, match=f"pid {os.getpid()}"):  # also within one process
            RunDirLock(run_dir).acquire()
    assert f"took over the lock of pid {holder.pid}" in rlloom_log.text
    assert (run_dir / ".lock").read_text() == ""


def test_resuming_a_finished_run_says_there_is_nothing_to_train(tiny_checkpoint, tmp_path, rlloom_log):
    run(tiny_cfg(tiny_checkpoint, tmp_path / "r", "trainer.total_steps=1", "trainer.save_every=1"))
    lines = (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()
    rlloom_log.clear()
    result = run(tiny_cfg(tiny_checkpoint, tmp_path / "r", "trainer.total_steps=1", "trainer.resume=auto"))
    assert result.steps == 1
    assert (tmp_path / "r" / "metrics.jsonl").read_text().splitlines() == lines  # nothing trained or logged
    warned = [r.getMessage() for r in rlloom_log.records if r.levelno == logging.WARNING]
    assert any("already at step 1 of trainer.total_steps=1: nothing to train" in m for m in warned), warned
