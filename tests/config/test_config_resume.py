"""A resume may change how long to train, saving, logging and speed settings, nothing else unasked."""

from __future__ import annotations

import dataclasses

import pytest

from rlloom.config import ConfigError, load_config, to_yaml
from rlloom.config.resume import FREE_TO_CHANGE, run_changing_differences
from rlloom.trainer.preflight import check_resume_config


def test_same_config_and_free_settings_give_no_difference():
    saved = load_config("arithmetic_smoke")
    assert run_changing_differences(saved, saved) == []
    longer = load_config(
        "arithmetic_smoke",
        [
            "trainer.total_steps=500",
            "trainer.save_every=5",
            "trainer.eval_every=3",
            "trainer.run_dir=elsewhere",
            "trainer.resume=auto",
            "logging.tensorboard=true",
            "rollout.num_blocks=128",
            "train.compile=false",
        ],
    )
    assert run_changing_differences(saved, longer) == []


def test_run_changing_settings_are_listed_with_both_values():
    saved = load_config("arithmetic_smoke")
    new = load_config(
        "arithmetic_smoke",
        ["train.lr=3e-5", "algorithm.estimator=rloo", "model.path=other", "rollout.temperature=0.7"],
    )
    assert run_changing_differences(saved, new) == [
        "algorithm.estimator: 'grpo' -> 'rloo'",
        "model.path: 'smollm2-135m-instruct' -> 'other'",
        "rollout.temperature: 1.0 -> 0.7",
        f"train.lr: {saved.train.lr!r} -> 3e-05",
    ]


def test_every_free_setting_names_a_real_field():
    cfg, flat = load_config("arithmetic_smoke"), set()
    for section in dataclasses.fields(cfg):
        flat.add(f"{section.name}.")
        flat.update(f"{section.name}.{f.name}" for f in dataclasses.fields(getattr(cfg, section.name)))
    assert set(FREE_TO_CHANGE) <= flat


def test_resume_check_reads_the_checkpoint_config_and_allow_flag_skips_it(tiny_checkpoint, tmp_path):
    model = f"model.path={tiny_checkpoint}"
    (tmp_path / "config.yaml").write_text(to_yaml(load_config("arithmetic_smoke", [model, "train.lr=1e-3"])))
    resume = f"trainer.resume={tmp_path}"
    with pytest.raises(ConfigError, match=r"train.lr: 0.001 -> 1e-05.*resume_allow_changes=true"):
        check_resume_config(tmp_path, load_config("arithmetic_smoke", [model, resume]))
    check_resume_config(
        tmp_path, load_config("arithmetic_smoke", [model, resume, "trainer.resume_allow_changes=true"])
    )
    check_resume_config(
        tmp_path, load_config("arithmetic_smoke", [model, resume, "train.lr=1e-3", "trainer.total_steps=99"])
    )
