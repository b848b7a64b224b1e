"""Files a run writes cannot be turned against the user (through the CLI, on the tiny model).

- A symbolic link planted in a run folder is refused with one line (exit 2), its target untouched:
  before, `config.yaml`, `metrics.jsonl`, `samples.jsonl` and `.lock` (truncated to 0 bytes) were
  written through it, and `hf/` or `checkpoints/` redirected whole folders.
- A model folder's link to a file outside the model never ships in `hf/step_N` or an export (links
  inside the model folder, and Hugging Face Hub cache snapshots' links to their blobs, are copied).
- Start-up housekeeping and `trainer.keep_last_checkpoints` touch only folders a save left: a user's
  `notes.old`, `notes` and `my.tmp.d`, and a link named like a checkpoint, survive.
- A full disk while writing the lock or `hf/step_N` is one line naming the file and the free space,
  with the checkpoint intact (the checkpoint's own full-disk case is in test_trainer_checkpoints.py).
"""

from __future__ import annotations

import errno
import json
import logging
import os
from pathlib import Path

import pytest
from safetensors import SafetensorError
from test_trainer_loop import tiny_args

from rlloom.cli import main
from rlloom.models import checkpoint as model_checkpoint
from rlloom.trainer.checkpoint import latest_checkpoint


@pytest.fixture
def rlloom_log(caplog):
    logger = logging.getLogger("rlloom")  # does not propagate to the root logger caplog listens on
    logger.addHandler(caplog.handler)
    yield caplog
    logger.removeHandler(caplog.handler)


def train(ckpt: Path, run_dir: Path, *extra: str) -> int:
    return main(["train", "arithmetic_smoke", *tiny_args(ckpt, run_dir, "trainer.total_steps=1", *extra)])


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("[rlloom] ")]  # logs
    assert len(lines) == 1 and lines[0].startswith("rlloom: error: ") and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize(
    "name", ["config.yaml", "metrics.jsonl", "samples.jsonl", ".lock", "hf", "checkpoints"]
)
def test_a_link_planted_in_the_run_folder_is_refused(name, tiny_checkpoint, tmp_path, capsys):
    run_dir, victim = tmp_path / "run", tmp_path / "victim"
    run_dir.mkdir()
    if name in ("hf", "checkpoints"):
        victim.mkdir()
        (victim / "keep.txt").write_text("mine")
    else:
        victim.write_text("mine")
    (run_dir / name).symlink_to(victim)
    assert train(tiny_checkpoint, run_dir, "trainer.resume=auto", "logging.samples_per_step=1") == 2
    line = one_error_line(capsys)
    assert f"{str(run_dir / name)!r} is a symbolic link" in line and "Fix: remove the link" in line
    if victim.is_dir():
        assert [p.name for p in victim.iterdir()] == ["keep.txt"]
    else:
        assert victim.read_text() == "mine"


def cache_snapshot(tiny: Path, root: Path, secret: Path) -> Path:
    """The tiny model laid out as the Hugging Face Hub cache does (every file a link to a blob), plus
    `vocab.txt`, a link to a secret outside the cache, and `merges.txt`, a link inside the snapshot."""
    repo = root / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abc"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in tiny.iterdir():
        blob = repo / "blobs" / f"sha-{file.name}"
        blob.write_bytes(file.read_bytes())
        (snapshot / file.name).symlink_to(Path("../../blobs") / blob.name)
    (snapshot / "vocab.txt").symlink_to(secret)
    (snapshot / "merges.txt").symlink_to("tokenizer_config.json")
    return snapshot


def test_links_out_of_the_model_folder_never_ship(tiny_checkpoint, tmp_path, capsys, rlloom_log):
    secret = tmp_path / "secret.txt"
    secret.write_text("api-key-123")
    model = cache_snapshot(tiny_checkpoint, tmp_path / "hub", secret)
    run_dir, out = tmp_path / "run", tmp_path / "export"
    assert train(model, run_dir) == 0
    assert main(["export", str(run_dir), str(out)]) == 0
    for folder in (run_dir / "hf" / "step_000001", out):
        names = {p.name for p in folder.iterdir()}
        assert "vocab.txt" not in names, folder
        assert {"tokenizer.json", "merges.txt", "model.safetensors"} <= names, names
        assert not any(p.is_symlink() for p in folder.iterdir())
        assert all("api-key" not in p.read_text(errors="replace") for p in folder.iterdir())
    assert (
        f"model file {model / 'vocab.txt'} is a link to {secret}, outside the model's folder"
        in rlloom_log.text
    )


def test_housekeeping_touches_only_what_a_save_left(tiny_checkpoint, tmp_path, capsys):
    run_dir, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    user = run_dir / "checkpoints"
    for folder in ("notes", "notes.old", "my.tmp.d", "step_000007.tmp-notes"):
        (user / folder).mkdir(parents=True)
        (user / folder / "keep.txt").write_text("mine")
    (elsewhere / "manifest.json").parent.mkdir()
    (elsewhere / "manifest.json").write_text("{}")  # looks complete to a check that follows links
    (user / "step_000000").symlink_to(elsewhere)
    (user / "step_000003.old").symlink_to(elsewhere)
    assert train(tiny_checkpoint, run_dir, "trainer.resume=auto", "trainer.keep_last_checkpoints=1") == 0
    for folder in ("notes", "notes.old", "my.tmp.d", "step_000007.tmp-notes"):
        assert (user / folder / "keep.txt").read_text() == "mine", folder
    assert (user / "step_000000").is_symlink() and (user / "step_000003.old").is_symlink()
    assert (elsewhere / "manifest.json").read_text() == "{}"
    assert latest_checkpoint(run_dir).name == "step_000001"


def test_a_full_disk_writing_the_lock_is_one_line(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    def disk_full(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwrite", disk_full)
    assert train(tiny_checkpoint, tmp_path / "run") == 2
    line = one_error_line(capsys)
    assert f"writing {str(tmp_path / 'run' / '.lock')!r} failed: No space left on device" in line
    assert "free on its disk). Fix: free disk space" in line


def test_a_full_disk_writing_hf_step_is_one_line_and_keeps_the_checkpoint(
    tiny_checkpoint, tmp_path, monkeypatch, capsys
):
    def disk_full(*args, **kwargs):  # what safetensors raises when the disk is full
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(model_checkpoint, "save_file", disk_full)
    run_dir = tmp_path / "run"
    # save_every: a full last checkpoint (else it holds the Hugging Face folder, and hf/step_N links to it)
    assert train(tiny_checkpoint, run_dir, "trainer.save_every=1") == 2
    line = one_error_line(capsys)
    hf = run_dir / "hf" / "step_000001"
    assert f"writing {str(hf)!r} failed: No space left on device (" in line and "free on its disk" in line
    assert f"rlloom export {run_dir} {hf}" in line and "checkpoint step_000001 is intact" in line
    assert list((run_dir / "hf").iterdir()) == []  # no partial folder
    assert latest_checkpoint(run_dir).name == "step_000001"
    assert (
        json.loads((run_dir / "checkpoints" / "step_000001" / "trainer_state.json").read_text())["step"] == 1
    )
