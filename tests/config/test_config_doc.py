"""The configuration reference: generated from the field docstrings, checked in, and kept current."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

from rlloom.cli import main
from rlloom.config import RunConfig
from rlloom.config.doc import REGENERATE, config_reference, field_docstrings

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def test_docs_config_md_is_current():
    assert DOC.is_file(), f"docs/config.md is missing. Regenerate it: {REGENERATE}"
    assert DOC.read_text() == config_reference(), (
        f"docs/config.md is out of date. Regenerate it: {REGENERATE}"
    )


def test_every_field_has_a_docstring_and_a_row():
    reference = config_reference()
    for section in dataclasses.fields(RunConfig):
        cls = typing.get_type_hints(RunConfig)[section.name]
        docs = field_docstrings(cls)
        for f in dataclasses.fields(cls):
            assert docs.get(f.name), f"{cls.__name__}.{f.name} has no docstring under it"
            assert f"| `{section.name}.{f.name}` |" in reference


def test_reference_shows_types_defaults_and_descriptions():
    reference = config_reference()
    assert "| `rollout.temperature` | float | `1.0` | Sampling temperature of the RL policy" in reference
    assert '| `model.dtype` | "auto" \\| "float32" \\| "bfloat16" | `"auto"` |' in reference
    assert "| `train.betas` | tuple[float, float] | `[0.9, 0.999]` |" in reference
    assert "| `rollout.stop_strings` | list[str] | `[]` |" in reference


def test_cli_prints_it(capsys):
    assert main(["config", "doc"]) == 0
    assert capsys.readouterr().out == config_reference()
