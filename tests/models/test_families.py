"""One home per model family (rlloom/models/families/): what differs between families is written in
the family's module and nowhere else, so adding a family is a module there plus its `FAMILIES` line."""

from __future__ import annotations

import ast
from pathlib import Path

from rlloom.models.adapter import StateDictAdapter
from rlloom.models.args import ModelArgs
from rlloom.models.families import FAMILIES
from rlloom.models.tiny import tiny_config

ROOT = Path(__file__).parents[2] / "rlloom"
FAMILY_DIR = ROOT / "models" / "families"


def test_a_model_type_is_named_only_in_its_family():
    """No module outside models/families/ branches on (or lists) a config.json model_type."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if FAMILY_DIR in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in FAMILIES:
                found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.value!r}")
    assert not found, "model types named outside rlloom/models/families/:\n" + "\n".join(found)


def test_each_model_type_belongs_to_one_family_whose_names_the_adapter_uses():
    model_types = [t for family in set(FAMILIES.values()) for t in family.model_types]
    assert sorted(model_types) == sorted(FAMILIES)  # no model type registered twice
    for kind in ("tiny-dense", "tiny-moe", "tiny-mla"):
        config = tiny_config(kind, vocab_size=64, eos=1, pad=0, hidden=32, layers=2)
        config = config if isinstance(config, dict) else config.to_dict()
        adapter = StateDictAdapter(ModelArgs.from_hf_config(config))
        assert adapter.family is FAMILIES[config["model_type"]]
        assert all(adapter.from_hf(f"model.layers.0.{name}") for name in adapter.family.names.layer)
