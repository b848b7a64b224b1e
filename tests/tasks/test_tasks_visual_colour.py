"""visual_colour: one solid colour a picture, four colours in turn in both splits (a constant answer
scores 0.25), held-out shades never trained on, and prompts that differ only in their picture."""

from pathlib import Path

from PIL import Image

from rlloom.tasks import default_reward_name
from rlloom.tasks.visual_colour import COLOURS, QUESTION, SHADE, visual_colour_prompts


def _prompts(folder: Path, split: str = "train", **kw) -> list:
    return visual_colour_prompts(split=split, folder=folder, **(dict(num_train=42, num_eval=10, seed=3) | kw))


def test_splits_are_balanced_deterministic_and_share_no_shade(tmp_path):
    train, again = _prompts(tmp_path / "a"), _prompts(tmp_path / "b")
    assert [(r.ground_truth, r.metadata) for r in train] == [(r.ground_truth, r.metadata) for r in again]
    evals = _prompts(tmp_path / "a", "eval")
    for rows, count in ((train, 42), (evals, 10)):  # the colours in turn: A B C D A ...
        assert [r.ground_truth for r in rows] == ["ABCD"[i % 4] for i in range(count)]
        assert [r.index for r in rows] == list(range(count))
    assert not {tuple(r.metadata["rgb"]) for r in train} & {tuple(r.metadata["rgb"]) for r in evals}
    assert len({tuple(r.metadata["rgb"]) for r in evals}) == 10
    assert [r.ground_truth for r in _prompts(tmp_path / "a", "eval", num_train=7)] == [
        r.ground_truth for r in evals
    ]  # the held-out shades do not depend on num_train


def test_each_picture_is_its_shade_and_the_colour_is_only_in_the_picture(tmp_path):
    rows = _prompts(tmp_path)
    for r in rows:
        assert r.prompt == QUESTION and r.metadata["task"] == "visual_colour"
        rgb = tuple(r.metadata["rgb"])
        assert all(abs(c - pure) <= SHADE for c, pure in zip(rgb, COLOURS[r.ground_truth]))
        picture = Image.open(r.images[0])
        assert picture.size == (28, 28) and picture.getextrema() == tuple((c, c) for c in rgb)
    assert Path(rows[0].images[0]).read_bytes() == Path(_prompts(tmp_path / "b")[0].images[0]).read_bytes()
    assert default_reward_name("visual_colour") == "choice"
