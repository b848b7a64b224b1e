"""One home per model family (rlloom/models/families/): what differs between families is written in
the family's module and nowhere else, so adding a family is a module there plus its `FAMILIES` line."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from rlloom.engines.rollout.native.tensor_parallel import shard_model
from rlloom.models.adapter import StateDictAdapter
from rlloom.models.args import ModelArgs
from rlloom.models.families import FAMILIES
from rlloom.models.families.tp_plan import Split, held
from rlloom.models.model import CausalLM
from rlloom.models.tiny import tiny_config
from rlloom.parallel.tp import apply_tp

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


def _configs() -> dict[str, dict]:
    """A tiny config.json of every model type (4 heads, 2 KV heads for GQA), DeepSeek-V3 also without q-LoRA."""

    def config(kind: str) -> dict:
        made = tiny_config(kind, vocab_size=64, eos=1, pad=0, hidden=32, layers=2)
        return made if isinstance(made, dict) else made.to_dict()

    dense, moe, mla = config("tiny-dense"), config("tiny-moe"), config("tiny-mla")
    return {
        "qwen2_5_vl": config("tiny-vl"),
        "qwen3_vl": config("tiny-vl3"),
        "qwen3": dense,
        "qwen2": dense | {"model_type": "qwen2"},
        "llama": dense | {"model_type": "llama", "attention_bias": True},
        "qwen3_moe": moe | {"mlp_only_layers": [0]},
        "mixtral": moe | {"model_type": "mixtral", "num_local_experts": 8, "sliding_window": None},
        "deepseek_v3": mla,
        "deepseek_v3 without q-LoRA": mla | {"q_lora_rank": None},
    }


def _held(layer: torch.nn.Module, plan: dict[str, Split]) -> dict[str, Split]:
    return {path: split for path, split in plan.items() if held(layer, path) is not None}


def test_a_family_tp_plan_names_every_parameter_of_its_layers_and_nothing_else():
    """Both engines skip what a layer lacks, so a misspelled plan entry would go unnoticed: every
    entry must be held by some layer of the family's models, and every layer parameter lie under one."""
    used: dict[int, set[str]] = {}
    for name, config in _configs().items():
        args = ModelArgs.from_hf_config(config)
        family = FAMILIES[args.model_type]
        with torch.device("meta"):
            model = CausalLM(args)
        for layer in model.layers:
            plan = _held(layer, family.tp)
            used.setdefault(id(family), set()).update(plan)
            for param, _ in layer.named_parameters():
                owners = [path for path in plan if param.startswith(path + ".")]
                assert len(owners) == 1, f"{name}: {param} lies under {owners} of its family's tp plan"
    for family in set(FAMILIES.values()):
        assert set(family.tp) == used[id(family)], f"{family.model_types}: entries no model holds"


TRAINING_PLACEMENT = {
    Split.COLUMN: Shard(0),
    Split.KV_COLUMN: Shard(0),
    Split.ROW: Shard(1),
    Split.REPLICATED: Replicate(),
    Split.SHARED_KEY: Replicate(),
    Split.HEAD_NORM: Replicate(),
    Split.TOKEN_NORM: Replicate(),
}
ROLLOUT_DIM = {Split.COLUMN: 0, Split.KV_COLUMN: 0, Split.ROW: 1}
"""The dim of its full weight a rollout rank cuts (none: the rank holds it whole)."""


@pytest.fixture
def two_fake_ranks():
    """Rank 0 of a 2-rank fake process group in this one process (collectives are no-ops)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


def test_training_and_rollout_tp_split_each_module_as_its_family_plan_says(two_fake_ranks):
    """The one declaration both engines read: at tp=2 each module of each layer is laid out as the
    family's plan says, by the training DTensor plan and by the rollout's in-place cut alike."""
    for name, config in _configs().items():
        args = ModelArgs.from_hf_config(config)
        plan = FAMILIES[args.model_type].tp
        trained = apply_tp(CausalLM(args), two_fake_ranks)
        rollout = CausalLM(dataclasses.replace(args, fused_projections=True))
        slices = shard_model(rollout, dist.group.WORLD).slices
        for i, layer in enumerate(trained.layers):
            for path, split in _held(layer, plan).items():
                module, key = layer.get_submodule(path), f"layers.{i}.{path}"
                if split is Split.EXPERTS:  # training: whole on every rank; rollout: every expert's width cut
                    assert not any(isinstance(p, DTensor) for p in module.parameters()), (name, key)
                    cuts = {w: slices[f"{key}.experts.{w}"].dim for w in ("w1", "w3", "w2")}
                    assert cuts == {"w1": 0, "w3": 0, "w2": 1}, (name, key, cuts)
                    continue
                assert module.weight.placements == (TRAINING_PLACEMENT[split],), (name, key, split)
                cut = slices.get(f"{key}.weight")
                assert (cut and cut.dim) == ROLLOUT_DIM.get(split), (name, key, split, cut)


def test_the_tp_engines_name_no_module_of_a_layer():
    """Training and rollout TP read which module splits how from the families' plans only: neither
    names a module of a decoder layer (`"wq"`, `"attention.wo"`, `"moe"`) in a string of its own."""
    names = {part for family in FAMILIES.values() for path in family.tp for part in (path, *path.split("."))}
    found = []
    for path in (ROOT / "parallel" / "tp.py", ROOT / "engines" / "rollout" / "native" / "tensor_parallel.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.value!r}")
    assert not found, "layer modules named outside the families' tp plans:\n" + "\n".join(found)
