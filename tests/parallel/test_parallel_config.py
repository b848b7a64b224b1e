"""The `parallel` config section: degrees checked against the world size when the config is built,
and against the model's shapes before it is loaded, each in one line naming every factor and the fix."""

from __future__ import annotations

import pytest

from rlloom.config import ConfigError, load_config
from rlloom.engines.train.build import check_parallel
from rlloom.trainer.preflight import model_hf_config

RAY = ["cluster.mode=ray"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["cluster.num_workers=3", "parallel.tp=2"],
            r"cluster.num_workers=3 is invalid: must be divisible by pp x cp x tp = 1 x 1 x 2 = 2 .*"
            r"Fix: use cluster.num_workers=4",
        ),
        (
            ["cluster.num_workers=4", "parallel.tp=2", "parallel.ep=3"],
            r"parallel.ep=3 is invalid: must divide dp x cp x tp = 2 x 1 x 2 = 4.*Fix: use a parallel.ep that divides 4",
        ),
        (
            [
                "cluster.num_workers=8",
                "parallel.pp=2",
                "parallel.tp=2",
                "parallel.cp=2",
                "train.share_prompts=false",
                "train.max_tokens_per_micro_batch=4098",
            ],
            r"train.max_tokens_per_micro_batch=4098 is invalid: parallel.pp=2 splits every micro-batch, padded to "
            r"this budget, into parallel.cp x parallel.tp = 2 x 2 equal token shares, so it must be a multiple of "
            r"4. Fix: set train.max_tokens_per_micro_batch=4100\.$",
        ),
        (
            ["cluster.num_workers=2", "parallel.cp=2", "train.share_prompts=true"],
            r"train.share_prompts=True is invalid: parallel.cp=2 splits plain packed documents, not "
            r"shared-prompt trees. Fix: set train.share_prompts=false \(or parallel.cp=1\)\.$",
        ),
        (["parallel.tp=0"], r"parallel.tp=0 is invalid: must be >= 1"),
        (
            ["cluster.num_workers=2", "parallel.tp=2", "parallel.sequence_parallel=false"],
            r"parallel.sequence_parallel=False is invalid",
        ),
    ],
)
def test_world_size_rules_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError, match=message) as info:
        load_config("arithmetic_smoke", RAY + overrides)
    assert "\n" not in str(info.value)


def test_degrees_are_checked_against_the_model(tiny_checkpoint, tiny_moe_checkpoint):
    def check(ckpt, *overrides):
        cfg = load_config("arithmetic_smoke", [f"model.path={ckpt}", *RAY, *overrides])
        check_parallel(cfg, model_hf_config(cfg.model.path))

    check(tiny_checkpoint, "cluster.num_workers=4", "parallel.tp=2")  # tp=2 x dp=2 fits
    check(tiny_checkpoint, "cluster.num_workers=4", "parallel.pp=2", "parallel.tp=2")  # pp=2 x tp=2 fits
    check(tiny_moe_checkpoint, "cluster.num_workers=4", "parallel.ep=4")
    with pytest.raises(
        ConfigError, match=r"parallel.tp=4 does not divide the model's num_key_value_heads=2 .*world=4"
    ):
        check(tiny_checkpoint, "cluster.num_workers=4", "parallel.tp=4")
    with pytest.raises(ConfigError, match=r"parallel.ep=2 needs a mixture-of-experts model"):
        check(tiny_checkpoint, "cluster.num_workers=2", "parallel.ep=2")
    cfg = load_config("arithmetic_smoke", [f"model.path={tiny_checkpoint}", *RAY, "cluster.num_workers=2"])
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.cp, cfg.parallel.ep) == (1, 1, 1, 1)
    assert cfg.parallel.sequence_parallel and cfg.parallel.schedule == "1f1b"
    cfg = load_config(
        "arithmetic_smoke", [*RAY, "cluster.num_workers=2", "parallel.cp=2", "train.share_prompts=false"]
    )
    assert cfg.parallel.cp == 2
