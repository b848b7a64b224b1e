"""A default never conflicts with another setting: every non-default value of a `parallel` key or of
trainer.mode, set alone on the recipe, validates; where a prerequisite is truly needed (more than
one worker for a parallel degree) the one-line error names every missing one at once, and setting
exactly those validates. Config validation only, no run."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from rlloom.config import ConfigError, ParallelConfig, TrainerConfig, load_config

ALONE = [
    "parallel.sequence_parallel=false",
    "parallel.pp_schedule=1f1b",
    "parallel.pp_schedule=interleaved",
    "parallel.pp_schedule=zero_bubble",
    "parallel.pp_virtual_stages=2",  # the default schedule turns interleaved
    "parallel.pp_first_stage_layers=1",
    "parallel.pp_last_stage_layers=1",
    "trainer.mode=one_step_off",
    "trainer.mode=async",
]
"""Keys that need nothing else."""

MORE_WORKERS = ["cluster.num_workers=2", "cluster.mode=ray"]
NEEDS = {
    "parallel.tp=2": MORE_WORKERS,
    "parallel.pp=2": MORE_WORKERS,
    "parallel.cp=2": MORE_WORKERS,  # train.share_prompts' default turns off under CP
    "parallel.ep=2": MORE_WORKERS,
}
"""Keys with a true prerequisite -> the settings the error must name."""


def test_every_parallel_key_and_mode_is_covered():
    covered = {item.split("=")[0] for item in [*ALONE, *NEEDS]}
    assert {f"parallel.{f.name}" for f in dataclasses.fields(ParallelConfig)} <= covered
    modes = typing.get_args(typing.get_type_hints(TrainerConfig)["mode"])
    assert {f"trainer.mode={m}" for m in modes if m != TrainerConfig().mode} <= set(ALONE)


@pytest.mark.parametrize("recipe", ["arithmetic_smoke", "dapo_arithmetic"])
@pytest.mark.parametrize("item", ALONE)
def test_a_key_alone_validates(recipe, item):
    load_config(recipe, [item])


@pytest.mark.parametrize("item, prerequisites", list(NEEDS.items()))
def test_a_key_with_prerequisites_names_them_all_in_one_line(item, prerequisites):
    with pytest.raises(ConfigError) as info:
        load_config("arithmetic_smoke", [item])
    message = str(info.value)
    assert "\n" not in message
    for needed in prerequisites:
        assert needed in message, (needed, message)
    load_config("arithmetic_smoke", [item, *prerequisites])
