"""Visual compare task: a picture of two numbers side by side, "Which number is larger, the left or
the right? Answer L or R.", with the side of the larger number ("L" or "R") as ground truth.

The numbers are only in the picture, never in the text: a model answers right more often than
half the time only by reading the picture. Each number has `num_digits` digits (0-9 for one
digit) and the two always differ, so the task is a two-way choice and chance is 0.5.

Pictures are drawn with Pillow's default font, black on white, one cell of 28 pixels high per
number (a Qwen2.5-VL merged token is 28 x 28 pixels, so one digit fills about one image token).
A picture depends only on its two numbers: it is drawn once into `picture_folder()` and named by
them, so runs, processes and the train and eval splits share the files, and a run needs no
dataset on disk. The reward is the built-in `choice` (`rlloom.rewards.choice`).
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

from rlloom.data.dataset import RawPrompt
from rlloom.tasks.pictures import saved_picture, task_folder
from rlloom.tasks.split import Problem, Split, draw_split

QUESTION = "Which number is larger, the left or the right? Answer L or R."
CELL = 28
"""Pixels per cell side: the height of a picture, and the width of one digit's cell."""
FONT_SIZE = 24


def picture_folder() -> Path:
    """Where the pictures are drawn: one folder per drawing version in the temp directory."""
    return task_folder("visual_compare-v1")


def draw_compare(rng: random.Random, *, num_digits: int) -> Problem:
    """One random problem: two different numbers of `num_digits` digits."""
    low = 0 if num_digits == 1 else 10 ** (num_digits - 1)
    high = 10**num_digits - 1
    left = rng.randint(low, high)
    right = left
    while right == left:
        right = rng.randint(low, high)
    return Problem(
        key=(left, right),
        prompt=QUESTION,
        ground_truth="L" if left > right else "R",
        metadata={"left": left, "right": right},
    )


def render_pair(left: int, right: int, num_digits: int):  # noqa: ANN201 (PIL.Image.Image, lazily)
    """The picture of two numbers: each centred in its own cell, black on white, RGB."""
    from PIL import Image, ImageDraw, ImageFont

    width = CELL * -(-(num_digits * FONT_SIZE // 2 + 8) // CELL)  # the digits and a margin, in whole cells
    picture = Image.new("RGB", (2 * width, CELL), "white")
    draw = ImageDraw.Draw(picture)
    font = ImageFont.load_default(size=FONT_SIZE)
    for i, number in enumerate((left, right)):
        draw.text((i * width + width / 2, CELL / 2), str(number), fill="black", font=font, anchor="mm")
    return picture


def picture_path(left: int, right: int, num_digits: int, folder: Path) -> str:
    """The file of a pair's picture in `folder`, drawn on first use."""
    return saved_picture(folder / f"{left}_{right}.png", lambda: render_pair(left, right, num_digits))


def visual_compare_prompts(
    *, split: Split, num_train: int, num_eval: int, num_digits: int, seed: int, folder: Path | None = None
) -> list[RawPrompt]:
    """The train or eval prompts (disjoint sets of number pairs, see `rlloom.tasks.split`), each
    with its picture (an `images` column: the chat template puts it before the question)."""
    raws = draw_split(
        lambda rng: draw_compare(rng, num_digits=num_digits),
        task="visual_compare",
        split=split,
        num_train=num_train,
        num_eval=num_eval,
        seed=seed,
    )
    where = folder or picture_folder()
    return [
        dataclasses.replace(
            raw, images=(picture_path(raw.metadata["left"], raw.metadata["right"], num_digits, where),)
        )
        for raw in raws
    ]
