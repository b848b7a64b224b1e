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
    assert "a weights-only checkpoint (trainer.save_weights_only=true)" in err
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
