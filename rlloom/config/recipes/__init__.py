"""Recipes: Python functions that return a full `RunConfig`. Variants derive in a few lines."""

from collections.abc import Callable

from rlloom.config.recipes.arithmetic import (
    arithmetic_demo,
    arithmetic_retry,
    arithmetic_sft,
    arithmetic_smoke,
    calculator_tools,
    dapo_arithmetic,
)
from rlloom.config.recipes.visual import visual_colour, visual_compare
from rlloom.config.run import RunConfig

RECIPES: dict[str, Callable[[], RunConfig]] = {
    "arithmetic_demo": arithmetic_demo,
    "arithmetic_smoke": arithmetic_smoke,
    "arithmetic_retry": arithmetic_retry,
    "arithmetic_sft": arithmetic_sft,
    "calculator_tools": calculator_tools,
    "dapo_arithmetic": dapo_arithmetic,
    "visual_colour": visual_colour,
    "visual_compare": visual_compare,
}
