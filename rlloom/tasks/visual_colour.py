"""Visual colour task: a picture of one solid colour, "Which colour? A) red B) green C) blue
D) yellow", with the colour's letter ("A" to "D") as ground truth.

The easiest honest test that a policy reads its picture: the colour is only in the picture, the
four colours are equally many in each split, so answering one letter to everything scores 0.25
and only a policy that looks scores more. Each problem is a shade: every channel of the colour's
pure value moved inwards by up to `SHADE` (red is (195-255, 0-60, 0-60)), so the held-out shades are
pictures never trained on, and no two colours' shades overlap.

A picture is 28 x 28 pixels: one image token of a Qwen2.5-VL (2 x 2 patches of 14 pixels, merged)
or of a Qwen3-VL (resized to 32: 2 x 2 patches of 16). It is drawn once into `picture_folder()`,
named by its shade. The reward is the built-in `choice` (`rlloom.rewards.choice`).
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

from rlloom.data.dataset import RawPrompt
from rlloom.tasks.pictures import saved_picture, task_folder
from rlloom.tasks.split import Problem, Split, draw_split

COLOURS = {"A": (255, 0, 0), "B": (0, 255, 0), "C": (0, 0, 255), "D": (255, 255, 0)}
"""Each answer letter's colour (red, green, blue, yellow) at its purest."""
QUESTION = "Which colour? A) red B) green C) blue D) yellow"
SHADE = 60
"""How far (0-255) a shade's channel may be from its colour's pure value (0 or 255)."""
SIDE = 28
"""Pixels per side of a picture."""


def picture_folder() -> Path:
    """Where the pictures are drawn: one folder per drawing version in the temp directory."""
    return task_folder("visual_colour-v1")


def draw_shade(rng: random.Random, letter: str) -> Problem:
    """One random shade of the colour of `letter`."""
    shade = tuple(
        abs(value - rng.randint(0, SHADE)) for value in COLOURS[letter]
    )  # 255 -> 195..255, 0 -> 0..60
    return Problem(key=shade, prompt=QUESTION, ground_truth=letter, metadata={"rgb": list(shade)})


def picture_path(rgb: tuple[int, int, int], folder: Path) -> str:
    """The file of a shade's picture in `folder`, drawn on first use."""
    from PIL import Image

    return saved_picture(folder / "{}_{}_{}.png".format(*rgb), lambda: Image.new("RGB", (SIDE, SIDE), rgb))


def visual_colour_prompts(
    *, split: Split, num_train: int, num_eval: int, seed: int, folder: Path | None = None
) -> list[RawPrompt]:
    """The train or eval prompts, each with its picture (an `images` column): the colours in turn
    (A, B, C, D, A, ...), each colour's shades drawn by `rlloom.tasks.split` from a stream of its
    own, so both splits are balanced and share no shade."""
    count = num_train if split == "train" else num_eval
    by_letter = [
        draw_split(
            lambda rng, letter=letter: draw_shade(rng, letter),
            task=f"visual_colour-{letter}",
            split=split,
            num_train=len(range(k, num_train, len(COLOURS))),
            num_eval=len(range(k, num_eval, len(COLOURS))),
            seed=seed,
        )
        for k, letter in enumerate(COLOURS)
    ]
    where = folder or picture_folder()
    return [
        dataclasses.replace(
            raw,
            index=i,
            metadata={**raw.metadata, "task": "visual_colour"},
            images=(picture_path(tuple(raw.metadata["rgb"]), where),),
        )
        for i, raw in enumerate(by_letter[i % len(COLOURS)][i // len(COLOURS)] for i in range(count))
    ]
