"""Weights-only checkpoints (`trainer.save_weights_only=true`), through the `rlloom` CLI: the
checkpoint holds the trained weights as a Hugging Face folder and no optimizer state, a resume from
it is refused with one line that says how to start from its weights, and `rlloom export` and
`rlloom eval` read it."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from rlloom.cli import main


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def test_weights_only_checkpoint_is_exported_and_not_resumed(tiny_checkpoint, tmp_path, capsys):
    run_dir = tmp_path / "run"
    common = ["arithmetic_smoke", f"model.path={tiny_checkpoint}", f"trainer.run_dir={run_dir}"]
    # lr 3e-2 so that one step visibly changes the weights.
    tiny = ["trainer.total_steps=1", "data.num_eval=0", "rollout.max_new_tokens=4", "train.lr=3e-2"]
    tiny += ["algorithm.entropy_coef=0.01", "data.num_train=16"]  # a gradient even when every reward is equal
    assert main(["train", *common, *tiny, "trainer.save_weights_only=true"]) == 0
    ckpt = run_dir / "checkpoints" / "step_000001"
    assert (ckpt / "hf" / "config.json").is_file() and not (ckpt / "engine").exists()
    saved = tensors(ckpt / "hf")
    initial = tensors(tiny_checkpoint)
    assert saved.keys() == initial.keys()
    assert any(not torch.equal(saved[k], initial[k]) for k in saved)  # the trained weights
    end_of_run = tensors(run_dir / "hf" / "step_000001")  # trainer.save_hf_every's folder at the end
    assert all(torch.equal(saved[k], end_of_run[k]) for k in saved)

    # Resuming is refused before loading, with the way to start a new run from these weights.
    capsys.readouterr()
    assert main(["train", *common, *tiny, "trainer.total_steps=2", "trainer.resume=auto"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlloom: error: trainer.resume='auto' found") and "\n" not in err
    assert "a weights-only checkpoint (trainer.save_weights_only=true, or the end of a run" in err
    assert f"model.path={ckpt / 'hf'}" in err

    # `rlloom export` takes the run folder (its newest checkpoint, weights-only here) as usual.
    assert main(["export", str(run_dir), str(tmp_path / "out")]) == 0
    exported = tensors(tmp_path / "out")
    assert exported.keys() == saved.keys()
    assert all(torch.equal(exported[k], saved[k].to(exported[k].dtype)) for k in saved)
    # So does `rlloom eval`.
    capsys.readouterr()
    assert main(["eval", str(run_dir), "arithmetic", "data.num_eval=2", "rollout.max_new_tokens=4"]) == 0
    assert '"prompts": 2' in capsys.readouterr().out


def disk_bytes(folder: Path) -> int:
    """Bytes the folder's files take on disk, a hard-linked file once."""
    seen: dict[tuple[int, int], int] = {}
    for p in folder.rglob("*"):
        if p.is_file():
            st = p.stat()
            seen[(st.st_dev, st.st_ino)] = st.st_size
    return sum(seen.values())


def test_a_run_that_ends_normally_keeps_weights_only_and_says_how_big(tiny_checkpoint, tmp_path, capsys):
    """trainer.save_every=0 (the default): the end-of-run checkpoint holds the weights without the
    optimizer state, its Hugging Face folder and RUN_DIR/hf/step_N are the same files, and the summary
    line gives the checkpoint's size; with trainer.save_every=K the last checkpoint stays full."""
    tiny = ["trainer.total_steps=2", "data.num_eval=0", "rollout.max_new_tokens=4", "data.num_train=16"]
    sizes, lines = {}, {}
    for name, extra in (("default", []), ("every_2", ["trainer.save_every=2"])):
        run_dir = tmp_path / name
        assert (
            main(
                [
                    "train",
                    "arithmetic_smoke",
                    f"model.path={tiny_checkpoint}",
                    f"trainer.run_dir={run_dir}",
                    *tiny,
                    *extra,
                ]
            )
            == 0
        )
        lines[name] = capsys.readouterr().out.strip().splitlines()[-1]
        sizes[name] = disk_bytes(run_dir / "checkpoints"), disk_bytes(run_dir)
    ckpt = tmp_path / "default" / "checkpoints" / "step_000002"
    assert (ckpt / "hf" / "config.json").is_file() and not (ckpt / "engine").exists()
    assert (tmp_path / "every_2" / "checkpoints" / "step_000002" / "engine").is_dir()
    for name, (ckpt_bytes, _) in sizes.items():
        assert lines[name].endswith(f" checkpoint_gb={ckpt_bytes / 2**30:.2f}"), lines[name]
    # the fp32 weights once, against the weights, AdamW's two moments and the Hugging Face folder
    assert sizes["default"][1] < 0.4 * sizes["every_2"][1]
    linked = (tmp_path / "default" / "hf" / "step_000002" / "model.safetensors").stat()
    assert linked.st_ino == (ckpt / "hf" / "model.safetensors").stat().st_ino and linked.st_nlink == 2

    # Training it further is refused with the way to continue; a run with save_every continues.
    more = ["trainer.total_steps=3", "trainer.resume=auto"]
    assert (
        main(
            [
                "train",
                "arithmetic_smoke",
                f"model.path={tiny_checkpoint}",
                f"trainer.run_dir={tmp_path / 'default'}",
                *tiny,
                *more,
            ]
        )
        == 2
    )
    assert "trainer.save_every=K > 0" in capsys.readouterr().err
    assert (
        main(
            [
                "train",
                "arithmetic_smoke",
                f"model.path={tiny_checkpoint}",
                f"trainer.run_dir={tmp_path / 'every_2'}",
                *tiny,
                *more,
                "trainer.save_every=2",
            ]
        )
        == 0
    )
