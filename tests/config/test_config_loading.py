"""Config: recipes, YAML, dotted overrides and validation map onto the same dataclasses."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlloom.cli import main
from rlloom.config import (
    ConfigError,
    RewardConfig,
    RunConfig,
    TrainEngineConfig,
    load_config,
    to_dict,
    to_yaml,
)
from rlloom.config.aliases import ALIASES, rlloom_keys
from rlloom.config.recipes import RECIPES
from rlloom.config.yaml_text import parse_override_value
from rlloom.trainer.run import seed_everything


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_recipe_round_trips_through_yaml(name, tmp_path):
    cfg = load_config(name)
    path = tmp_path / "cfg.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(path) == cfg


def test_overrides_set_typed_fields():
    cfg = load_config(
        "arithmetic_demo", ["algorithm.eps_high=0.28", "trainer.total_steps=50", "train.betas=[0.9,0.95]"]
    )
    assert cfg.algorithm.eps_high == 0.28
    assert cfg.trainer.total_steps == 50
    assert cfg.train.betas == (0.9, 0.95)
    # Everything else is the recipe.
    base = load_config("arithmetic_demo")
    assert dataclasses.replace(cfg, algorithm=base.algorithm, trainer=base.trainer, train=base.train) == base


def test_exponent_without_dot_is_a_number():
    assert load_config("arithmetic_demo", ["train.lr=1e-6"]).train.lr == 1e-6


def test_int_accepted_for_float_field():
    cfg = load_config("arithmetic_demo", ["train.lr=1"])
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)


def test_yaml_file_with_recipe_base(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("recipe: arithmetic_demo\nrollout:\n  n_samples: 16\n")
    cfg = load_config(path, ["rollout.max_new_tokens=12"])
    assert cfg.rollout.n_samples == 16 and cfg.rollout.max_new_tokens == 12
    recipe = load_config("arithmetic_demo").trainer
    assert cfg.trainer == dataclasses.replace(recipe, run_dir="runs/run")  # the file's own run folder


@pytest.mark.parametrize(
    "override, needles",
    [
        (["algorithm.eps_hgh=0.28"], ["algorithm.eps_hgh", "did you mean 'algorithm.eps_high'"]),
        (["algorthm.eps_high=0.28"], ["algorthm", "did you mean 'algorithm'"]),
        (["rollout.temperature=0"], ["rollout.temperature=0.0", "greedy", "Fix"]),
        (["train.lr=abc"], ["train.lr='abc'", "number"]),
        (["trainer.total_steps=1.5"], ["trainer.total_steps=1.5", "integer"]),
        (["algorithm.agg_mode=token_mean"], ["one of", "Fix: e.g. algorithm.agg_mode=token-mean."]),
        (["rollout.n_samples=1"], ["rollout.n_samples=1", "groups of 2"]),
        (["trainer.num_mini_batches=3"], ["must divide the batch of 32"]),
        (["cluster.num_workers=2"], ["cluster.mode=ray"]),
        (["noequals"], ["section.key=value"]),
    ],
)
def test_bad_input_names_key_value_and_fix(override, needles):
    with pytest.raises(ConfigError) as err:
        load_config("arithmetic_demo", override)
    for needle in needles:
        assert needle in str(err.value)


def test_unknown_source_lists_recipes():
    with pytest.raises(ConfigError, match="arithmetic_demo"):
        load_config("arithmetic_dem")


@pytest.mark.parametrize("content", ["", "# only a comment\n", "recipe: arithmetic_demo\n"])
def test_empty_yaml_file_is_the_defaults_or_its_recipe(tmp_path, content):
    path = tmp_path / "empty.yaml"
    path.write_text(content)
    want = load_config("arithmetic_demo") if "recipe" in content else RunConfig()
    # A YAML file's plug-in rewards are imported from its own folder, and its run has its own folder.
    want = dataclasses.replace(
        want,
        reward=dataclasses.replace(want.reward, import_dir=str(tmp_path)),
        trainer=dataclasses.replace(want.trainer, run_dir="runs/empty"),
    )
    assert load_config(path) == want


def test_yaml_paths_are_relative_to_the_file_and_its_run_has_its_own_folder(tmp_path, monkeypatch):
    folder = tmp_path / "experiments"
    folder.mkdir()
    (folder / "model").mkdir()
    (folder / "exp1.yaml").write_text(
        "recipe: arithmetic_demo\ndata: {task: jsonl, path: data/train.jsonl}\nmodel: {path: model}\n"
    )
    monkeypatch.chdir(tmp_path)  # not the file's folder
    cfg = load_config(folder / "exp1.yaml")
    assert cfg.data.path == str(folder / "data" / "train.jsonl")
    assert cfg.model.path == str(folder / "model")
    assert cfg.trainer.run_dir == "runs/exp1"  # not the recipe's runs/arithmetic_demo
    # a name that is not a folder next to the file stays a name; overrides stay as given
    (folder / "exp2.yaml").write_text("model: {path: smollm2-135m-instruct}\ntrainer: {run_dir: out/x}\n")
    cfg = load_config(folder / "exp2.yaml", ["data.task=jsonl", "data.path=rel.jsonl"])
    assert cfg.model.path == "smollm2-135m-instruct" and cfg.trainer.run_dir == "out/x"
    assert cfg.data.path == "rel.jsonl"


def test_yaml_unknown_key_rejected(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("trainer:\n  total_step: 3\n")
    with pytest.raises(ConfigError, match="did you mean 'trainer.total_steps'"):
        load_config(path)


def test_home_is_expanded_in_run_dir_and_resume(monkeypatch):
    monkeypatch.setenv("HOME", "/home/someone")
    cfg = load_config(
        "arithmetic_demo", ["trainer.run_dir=~/runs/a", "trainer.resume=~/runs/a/checkpoints/step_000002"]
    )
    assert cfg.trainer.run_dir == "/home/someone/runs/a"
    assert cfg.trainer.resume == "/home/someone/runs/a/checkpoints/step_000002"
    assert load_config("arithmetic_demo", ["trainer.resume=auto"]).trainer.resume == "auto"


@pytest.mark.parametrize(
    "raw, value", [("'a #b'", "a #b"), ("a#b", "a#b"), ('"#x"', "#x"), ("[1, 2]", [1, 2])]
)
def test_override_keeps_a_hash_that_is_not_a_comment(raw, value):
    assert parse_override_value("reward.name", raw) == value


@pytest.mark.parametrize("seed", [0, 2**32 - 1])
def test_seed_range_ends_are_accepted_by_every_rng(seed):
    cfg = load_config("arithmetic_demo", [f"trainer.seed={seed}", f"data.seed={seed}"])
    seed_everything(cfg.trainer.seed)


def test_non_finite_floats_refused_in_python_built_configs_too():
    with pytest.raises(ConfigError, match=r"reward.default_score=nan is invalid: must be a finite number"):
        RewardConfig(default_score=float("nan"))
    with pytest.raises(ConfigError, match=r"train.lr=inf"):
        TrainEngineConfig(lr=float("inf"))


def test_to_dict_is_plain_data():
    data = to_dict(RunConfig())
    assert yaml.safe_load(yaml.safe_dump(data)) == data


def test_cli_config_show_round_trips(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "rlloom.cli", "config", "show", "arithmetic_demo", "algorithm.kl_coef=0.01"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    path = tmp_path / "shown.yaml"
    path.write_text(out)
    # The same config, except that the saved file's run goes to runs/<file name>: a recipe's
    # trainer.run_dir is shown as a comment, so a file saved from it does not run in the recipe's folder.
    assert "  # run_dir: runs/arithmetic_demo " in out
    expected = load_config("arithmetic_demo", ["algorithm.kl_coef=0.01", "trainer.run_dir=runs/shown"])
    assert load_config(path) == expected


@pytest.mark.parametrize(
    "argv", [["--help"], ["train", "--help"], ["config", "show", "--help"], ["plot", "--help"]]
)
def test_cli_help(argv, capsys):
    # In this process (`python -m rlloom.cli` itself runs in the config show test above)
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 0 and "usage: rlloom" in capsys.readouterr().out


def test_a_run_folder_loads_the_config_its_run_wrote(tmp_path):
    cfg = load_config("arithmetic_smoke", [f"trainer.run_dir={tmp_path}", "train.lr=3e-4"])
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    assert load_config(tmp_path) == cfg
    assert load_config(str(tmp_path), ["trainer.total_steps=7"]).trainer.total_steps == 7


def test_every_alias_names_real_rlloom_keys():
    known = set()
    for section, fields in to_dict(RunConfig()).items():
        known |= {f"{section}.{name}" for name in fields}
    assert {key for keys in ALIASES.values() for key in keys} <= known
    assert rlloom_keys("actor_rollout_ref.actor.optim.lr") == ("train.lr",)
    assert rlloom_keys("critic.optim.lr") == ("critic.lr",)  # the longest tail wins
    assert rlloom_keys("trainer.sed") == ()
    guide = (Path(__file__).parents[2] / "docs" / "guide.md").read_text().split("Coming from TRL or verl")[1]
    assert [name for name in ALIASES if f"`{name}`" not in guide] == []  # the guide's table shows them all
