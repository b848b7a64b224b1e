"""visual_compare: pictures of two numbers drawn deterministically with Pillow, disjoint train and
eval pairs, the exact `choice` reward, and rows that go through the data pipeline with their pictures
into a tiny Qwen2.5-VL's image tokens."""

from pathlib import Path

import pytest
from PIL import Image

from rlloom.config import DataConfig
from rlloom.models.checkpoint import load_image_processing
from rlloom.models.tiny import write_tiny_model
from rlloom.rewards import get_reward_fn
from rlloom.tasks import build_task_source, default_reward_name
from rlloom.tasks.visual_compare import QUESTION, visual_compare_prompts


def _prompts(folder: Path, split: str = "train", **kw) -> list:
    args = dict(num_train=40, num_eval=10, num_digits=1, seed=3) | kw
    return visual_compare_prompts(split=split, folder=folder, **args)


def test_pictures_and_rows_are_deterministic_and_eval_pairs_held_out(tmp_path):
    a, b = _prompts(tmp_path / "a"), _prompts(tmp_path / "b")
    assert [(r.ground_truth, r.metadata, Path(r.images[0]).name) for r in a] == [
        (r.ground_truth, r.metadata, Path(r.images[0]).name) for r in b
    ]
    for ra, rb in zip(a, b):  # the same pixels, drawn twice in two folders
        assert Path(ra.images[0]).read_bytes() == Path(rb.images[0]).read_bytes()
    for r in a:  # the numbers are in the picture only; the answer is the larger one's side
        assert r.prompt == QUESTION and not any(c.isdigit() for c in r.prompt)
        left, right = r.metadata["left"], r.metadata["right"]
        assert left != right and r.ground_truth == ("L" if left > right else "R")
    picture = Image.open(a[0].images[0])
    assert picture.size == (56, 28) and picture.getextrema() == ((0, 255),) * 3  # black digits on white
    evals = _prompts(tmp_path / "a", "eval")
    assert len(evals) == 10 and len({(r.metadata["left"], r.metadata["right"]) for r in evals}) == 10
    pairs = {(r.metadata["left"], r.metadata["right"]) for r in a}
    assert not pairs & {(r.metadata["left"], r.metadata["right"]) for r in evals}
    assert {r.ground_truth for r in a} == {"L", "R"}
    assert Image.open(_prompts(tmp_path / "c", num_digits=2)[0].images[0]).size == (112, 28)
    with pytest.raises(ValueError, match="found only 90 distinct problems"):
        _prompts(tmp_path / "a", num_eval=91)


def test_choice_reward_is_exact():
    reward = get_reward_fn(default_reward_name("visual_compare"))
    assert reward("L", "L") == reward(" R\n", "R") == 1.0
    assert reward("R", "L") == 0.0  # wrong
    for malformed in ("l", "L.", "Left", "L R", "", "The answer is L"):
        assert reward(malformed, "L") == 0.0, malformed


def test_rows_load_through_the_data_pipeline_with_their_pictures(tmp_path):
    from transformers import AutoTokenizer

    model = write_tiny_model("tiny-vl", tmp_path / "vl")
    images = load_image_processing(model)
    cfg = DataConfig(task="visual_compare", num_digits=1, num_train=4, num_eval=2, seed=3)
    import rlloom.tasks.visual_compare as task

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(task, "picture_folder", lambda: tmp_path / "pictures")
        source = build_task_source(cfg, AutoTokenizer.from_pretrained(model), "eval", images=images)
    assert len(list((tmp_path / "pictures").glob("*.png"))) == 2
    for item in source.items:
        # a 56 x 28 picture: 2 x 4 patches of 14 pixels, merged 2 x 2 into two image tokens
        assert item.images.grid_thw.tolist() == [[1, 2, 4]]
        assert item.images.pixel_values.shape[0] == 8
        assert item.prompt_ids.count(images.image_token_id) == 2
        assert item.prompt_text.endswith(f"{QUESTION}<|im_end|>\n<|im_start|>assistant\n")
