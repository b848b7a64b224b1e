"""Qwen2.5-VL through `rlloom train` and dataset rows with pictures: a tiny-vl model trains on text
prompts and on picture rows (two Ray workers under FSDP equal the one-process run) and its export
loads in transformers and generates, and a tiny Qwen3-VL trains on picture rows; rows with images are read with Pillow (unreadable or oversized
pictures skipped as bad rows), and the start-up refuses, in one line each, a missing picture, pictures
for a text-only model, pictures without the chat template, a VL folder without its image processor or
with a template that writes no image placeholders, and a split layout for a VL model."""

from __future__ import annotations

import importlib
import json
import logging
import shutil
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer

import rlloom.data.images as images_mod
from rlloom.cli import main
from rlloom.data.dataset import DataError, load_prompt_file
from rlloom.models.tiny import CHAT_TEMPLATE, write_tiny_model

sys.path.insert(0, str(Path(__file__).parent))
from test_trainer_loop import read_metrics  # noqa: E402


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
    missing = _image_rows(tmp_path / "missing", [_row("ok.png"), _row("gone.png")] * 2)
    err = _error(capsys, _args(tiny_vl, tmp_path / "r3", "data.task=jsonl", f"data.path={missing}"))
    assert "gone.png', which is not a file" in err
    err = _error(
        capsys, _args(tiny_vl, tmp_path / "r4", "rollout.tp=2", "cluster.mode=ray", "cluster.num_workers=2")
    )
    assert "rollout.tp=2 is invalid for model.path=" in err and "data parallel only" in err
    err = _error(capsys, _args(tiny_vl, tmp_path / "r5", *on_file, "data.chat_template=false"))
    assert "has images (1) but data.chat_template=false" in err
    no_processor = tmp_path / "no_processor"
    shutil.copytree(tiny_vl, no_processor)
    (no_processor / "preprocessor_config.json").unlink()
    err = _error(capsys, _args(no_processor, tmp_path / "r6", *on_file))
    assert "has no preprocessor_config.json" in err
    text_template = tmp_path / "text_template"
    shutil.copytree(tiny_vl, text_template)
    tokenizer = AutoTokenizer.from_pretrained(text_template)
    tokenizer.chat_template = CHAT_TEMPLATE  # prints a part list as it is: no placeholder
    tokenizer.save_pretrained(text_template)
    err = _error(capsys, _args(text_template, tmp_path / "r7", *on_file))
    assert "writes 0 image placeholders" in err


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


def _picture_rows(folder: Path) -> Path:
    """Eight rows asking for a picture's colour, drawn with Pillow (chat image parts and an images
    column, one and two pictures a row), two of them text only."""
    folder.mkdir(parents=True, exist_ok=True)
    colours = ["red", "blue", "green", "white"]
    for i, colour in enumerate(colours):
        Image.new("RGB", (40 + 16 * i, 56), colour).save(folder / f"{colour}.png")
    rows = []
    for i, colour in enumerate(colours * 2):
        if i % 4 == 3:
            rows.append({"prompt": f"Say {colour}.", "answer": colour})
        elif i % 2:
            rows.append({"prompt": "Colour?", "images": [f"{colour}.png"], "answer": colour})
        else:
            pictures = [{"type": "image", "image": f"{c}.png"} for c in (colour, colours[i // 2 % 4])]
            text = {"type": "text", "text": "First colour?"}
            rows.append({"prompt": [{"role": "user", "content": [*pictures, text]}], "answer": colour})
    path = folder / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")  # the session's one Ray instance
def test_training_on_pictures_two_ray_workers_match_one_process_and_export_generates(tiny_vl, tmp_path):
    """`rlloom train` two steps on picture and text rows at lr 3e-2: the dp=2 run (FSDP over gloo) logs the
    one-process run's metrics, the rollout's logprobs equal the trainer's, the tower trains, and the
    exported folder loads in transformers and generates from a picture prompt."""
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    from rlloom.models.checkpoint import load_image_processing

    data = _picture_rows(tmp_path / "data")
    dense_reward = ["reward.name=resume_reward:digit_share", f"reward.import_dir={Path(__file__).parent}"]
    common = [
        "data.task=jsonl", f"data.path={data}", "data.num_eval=1", "trainer.total_steps=2", "train.lr=3e-2",
        "algorithm.is_correction=tis", *dense_reward,
        # a micro-batch a prompt: some hold no picture, so some ranks run micro-batches without the tower
        "train.max_tokens_per_micro_batch=1",
    ]  # fmt: skip
    assert main(_args(tiny_vl, tmp_path / "one", *common)) == 0
    ray = ["cluster.mode=ray", "cluster.num_workers=2"]
    assert main(_args(tiny_vl, tmp_path / "dp2", *common, *ray)) == 0
    want, got = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "dp2")
    assert [r["step"] for r in got] == [r["step"] for r in want] == [0, 1, 2]  # 0: the first evaluation
    for a, b in zip(want, got):
        # the transport's pieces differ, and each rank counts its own micro-batches
        skip = {k for k in a if k.startswith("sync/")} | {"train/num_micro_batches"}
        assert a.keys() == b.keys()
        for k in a.keys() - skip:
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), (b["step"], k)
        if a["step"]:
            assert a["rollout/logp_gap_abs"] < 1e-5 and b["rollout/logp_gap_abs"] < 1e-5
    folder = tmp_path / "one" / "hf" / "step_000002"
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder).eval()
    start = dict(Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_vl).named_parameters())
    vision = "model.visual.blocks.0.mlp.up_proj.weight"
    assert not torch.equal(dict(hf.named_parameters())[vision], start[vision])  # the tower trained
    tokenizer = AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    images = load_image_processing(folder)
    assert isinstance(images.processor, type(AutoImageProcessor.from_pretrained(folder)))
    ids, pixels = images.prompt(list(ids), (str(data.parent / "red.png"),))
    prompt = torch.tensor([ids])
    with torch.no_grad():
        out = hf.generate(
            input_ids=prompt, pixel_values=pixels.pixel_values, image_grid_thw=pixels.grid_thw,
            mm_token_type_ids=(prompt == images.image_token_id).int(), max_new_tokens=4, do_sample=False,
        )  # fmt: skip
    assert out.shape[1] > prompt.shape[1]


def test_qwen3_vl_trains_on_pictures(tmp_path):
    """`rlloom init-model tiny-vl3` (Qwen3-VL, DeepStack) through `rlloom train` on picture rows: the
    rollout's logprobs equal the trainer's and the tower trains."""
    from transformers import Qwen3VLForConditionalGeneration

    model = write_tiny_model("tiny-vl3", tmp_path / "ckpt")
    data = _picture_rows(tmp_path / "data")
    dense_reward = ["reward.name=resume_reward:digit_share", f"reward.import_dir={Path(__file__).parent}"]
    args = _args(
        model, tmp_path / "run", "data.task=jsonl", f"data.path={data}", "data.num_eval=1",
        "trainer.total_steps=2", "train.lr=3e-2", "algorithm.is_correction=tis", *dense_reward,
    )  # fmt: skip
    assert main(args) == 0
    assert all(r["rollout/logp_gap_abs"] < 1e-5 for r in read_metrics(tmp_path / "run") if r["step"])
    trained = Qwen3VLForConditionalGeneration.from_pretrained(tmp_path / "run" / "hf" / "step_000002")
    start = dict(Qwen3VLForConditionalGeneration.from_pretrained(model).named_parameters())
    name = "model.visual.blocks.0.attn.qkv.weight"
    assert not torch.equal(dict(trained.named_parameters())[name], start[name])


@pytest.mark.parametrize("recipe", ["visual_compare", "visual_colour"])
def test_visual_recipe_trains_a_step_on_drawn_pictures(recipe, tiny_vl, tmp_path, monkeypatch, capsys):
    """`rlloom train visual_compare model.path=<tiny-vl>` (and visual_colour): the task draws its
    pictures, the model evaluates and trains one step on them with the exact `choice` reward, and
    `rlloom eval RUN visual_compare` scores the run's held-out problems."""
    task = importlib.import_module(f"rlloom.tasks.{recipe}")
    monkeypatch.setattr(task, "picture_folder", lambda: tmp_path / "pictures")
    args = [
        "train", recipe, f"model.path={tiny_vl}", f"trainer.run_dir={tmp_path / 'run'}",
        "trainer.total_steps=1", "trainer.prompts_per_step=2", "rollout.n_samples=2", "data.num_train=4",
        "data.num_eval=2", "logging.console=false", "rollout.kv_cache_memory_gb=0.05",
    ]  # fmt: skip
    assert main(args) == 0
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [0, 1]  # 0: the first evaluation
    assert list((tmp_path / "pictures").glob("*.png"))
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["reward"] == float(s["response"] == s["ground_truth"]) for s in samples)
    assert main(["eval", str(tmp_path / "run"), recipe]) == 0  # the run's held-out problems
    assert '"prompts": 2' in capsys.readouterr().out
