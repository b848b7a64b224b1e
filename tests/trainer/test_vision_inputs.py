"""Qwen2.5-VL through `rlloom train` and dataset rows with pictures: a tiny-vl model trains on text
prompts and its export loads in transformers; rows with images are read with Pillow (unreadable or
oversized pictures skipped as bad rows), and the start-up refuses, in one line each, a missing picture,
pictures for a text-only model, image rows for training (not wired yet) and a split layout for a VL model."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from PIL import Image

import rlloom.data.images as images_mod
from rlloom.cli import main
from rlloom.data.dataset import DataError, load_prompt_file
from rlloom.models.tiny import write_tiny_model


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory) -> Path:
    return write_tiny_model("tiny-vl", tmp_path_factory.mktemp("tiny_vl") / "ckpt")


def _args(model: Path, run_dir: Path, *extra: str) -> list[str]:
    """`rlloom train` of the arithmetic_smoke recipe on a tiny model (its own total_steps)."""
    return [
        "train", "arithmetic_smoke", f"model.path={model}", f"trainer.run_dir={run_dir}", "data.num_eval=2",
        "data.num_train=16", "rollout.max_new_tokens=4", "logging.console=false",
        "rollout.kv_cache_memory_gb=0.05", *extra,
    ]  # fmt: skip


def _image_rows(folder: Path, rows: list[dict]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (40, 30), "red").save(folder / "ok.png")
    (folder / "broken.png").write_bytes(b"\x89PNG not really")
    Image.new("RGB", (64, 64), "blue").save(folder / "big.png")
    path = folder / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _row(image: str, column: bool = False) -> dict:
    text = {"type": "text", "text": "Which colour?"}
    if column:
        return {"prompt": "Which colour?", "images": [image], "answer": "red"}
    return {
        "prompt": [{"role": "user", "content": [{"type": "image", "image": image}, text]}],
        "answer": "red",
    }


def test_image_rows_read_with_pillow_and_bad_pictures_counted(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(images_mod, "MAX_IMAGE_PIXELS", 50 * 50)  # big.png (64 x 64) is oversized
    rows = [_row("ok.png"), _row("broken.png"), _row("big.png"), _row("ok.png", column=True)]
    path = _image_rows(tmp_path / "data", rows)
    with caplog.at_level(logging.WARNING):
        prompts = load_prompt_file(path)
    assert [p.images for p in prompts] == [(str(tmp_path / "data" / "ok.png"),)] * 2
    assert (
        "skipped 2 of 4 rows" in caplog.text and "does not read" in caplog.text and "oversized" in caplog.text
    )
    missing = _image_rows(tmp_path / "missing", [_row("ok.png"), _row("gone.png")])
    with pytest.raises(DataError, match=r"line 2 names image .*gone.png', which is not a file"):
        load_prompt_file(missing)


def _error(capsys, args: list[str]) -> str:
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlloom: error: ") and "\n" not in err and "Traceback" not in err, err
    return err


def test_start_up_refuses_image_rows_missing_pictures_and_split_vl_layouts(
    tiny_vl, tiny_checkpoint, tmp_path, capsys
):
    data = _image_rows(tmp_path / "data", [_row("ok.png")] * 4)
    on_file = ["data.task=jsonl", f"data.path={data}", "data.num_eval=1"]
    err = _error(capsys, _args(tiny_checkpoint, tmp_path / "r1", *on_file))
    assert "has images (1) but model.path=" in err and "text-only qwen3 model" in err
    err = _error(capsys, _args(tiny_vl, tmp_path / "r2", *on_file))
    assert "does not train on images yet" in err
    missing = _image_rows(tmp_path / "missing", [_row("ok.png"), _row("gone.png")] * 2)
    err = _error(capsys, _args(tiny_vl, tmp_path / "r3", "data.task=jsonl", f"data.path={missing}"))
    assert "gone.png', which is not a file" in err
    err = _error(
        capsys, _args(tiny_vl, tmp_path / "r4", "rollout.tp=2", "cluster.mode=ray", "cluster.num_workers=2")
    )
    assert "rollout.tp=2 is invalid for model.path=" in err and "data parallel only" in err


def test_vl_model_trains_on_text_and_its_export_loads_in_transformers(tiny_vl, tmp_path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    dense_reward = ["reward.name=resume_reward:digit_share", f"reward.import_dir={Path(__file__).parent}"]
    assert (
        main(_args(tiny_vl, tmp_path / "run", "trainer.total_steps=2", "train.lr=3e-2", *dense_reward)) == 0
    )
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path / "run" / "hf" / "step_000002").eval()
    trained = dict(hf.named_parameters())
    start = dict(Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_vl).named_parameters())
    name = "model.language_model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(trained[name], start[name])  # the decoder trained
    vision = "model.visual.blocks.0.mlp.up_proj.weight"
    assert torch.equal(trained[vision], start[vision])  # text prompts give the tower no gradient
