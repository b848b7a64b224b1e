"""The whole RL run through the `rlloom train` CLI with Ray workers and pipeline parallelism
(parallel.pp=2) gives the one-process run's per-step metrics within rel 1e-4: 1F1B at pp=2 x tp=2 on
4 workers with an uneven split (1 + 3 layers; the stages tensor-parallel, the last one's head
vocabulary-parallel; even splits and every schedule run in test_pp.py), on a 4-layer tiny Qwen3 with
tied embeddings (the last stage holds the embedding as its head); and the interleaved schedule (2
virtual stages per rank: each rank holds two layers that are not neighbours) on a 4-layer tiny
Qwen3-MoE at pp=2 x ep=2 on 4 workers with a rollout worker of its own (owner-only weight sync), the
rollout's routes replayed (its MoE load and route-mismatch metrics match too). Each layout's final
Hugging Face export (full tensors gathered from every stage, TP shard and EP rank) holds the
one-process run's weights. The learning rate (3e-2) is large enough that a wrong gradient changes
the samples; the KL term runs the frozen reference through the same pipeline. The layouts join the
session's one Ray instance."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("ray", reason="needs the ray extra: pip install 'rlloom[ray]'")

from rlloom.cli import main  # noqa: E402
from tests.conftest import build_tiny_checkpoint  # noqa: E402

SKIP = ("time/", "perf/", "sync/ms", "memory/")
PP2_TP2_UNEVEN = [
    "cluster.num_workers=4",
    "parallel.pp=2",
    "parallel.tp=2",
    "parallel.pp_first_stage_layers=1",
]


@pytest.fixture(scope="module")
def four_layer_checkpoint(tmp_path_factory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny4") / "ckpt", layers=4)


@pytest.fixture(scope="module")
def four_layer_moe_checkpoint(tmp_path_factory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny4moe") / "ckpt", layers=4, moe=True)


def hf_export(run_dir: Path) -> dict[str, torch.Tensor]:
    """The tensors of the run's last Hugging Face export (written by every rank from `named_weights`)."""
    (folder,) = sorted((run_dir / "hf").iterdir())[-1:]
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def train(ckpt: Path, run_dir: Path, *extra: str) -> list[dict]:
    overrides = [
        f"model.path={ckpt}",
        f"trainer.run_dir={run_dir}",
        "trainer.total_steps=2",
        "trainer.prompts_per_step=4",
        "rollout.n_samples=4",
        "data.num_eval=0",
        "data.num_train=64",
        "rollout.max_new_tokens=6",
        "train.lr=3e-2",
        "train.max_tokens_per_micro_batch=160",
        "data.max_prompt_length=150",  # + 6 new tokens: every sample fits the budget PP pads to
        "algorithm.kl_coef=0.05",
        "reward.name=resume_reward:digit_share",  # a reward a random model earns, so the policy moves
        f"reward.import_dir={Path(__file__).parents[1] / 'trainer'}",
        "logging.console=false",
        *extra,
    ]
    assert main(["train", "arithmetic_smoke", *overrides]) == 0
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(SKIP)} for r in rows]


@pytest.mark.slow
def test_pipeline_parallel_ray_runs_match_one_process(
    ray_cluster, four_layer_checkpoint, four_layer_moe_checkpoint, tmp_path
):
    expected = train(four_layer_checkpoint, tmp_path / "one")
    expected_hf = hf_export(tmp_path / "one")
    assert [r["step"] for r in expected] == [1, 2]
    # The policy moves: step 2's samples come from the weights step 1 trained.
    assert expected[0]["train/grad_norm"] > 0 and expected[0]["reward/mean"] != expected[1]["reward/mean"]
    got = train(four_layer_checkpoint, tmp_path / "pp2_tp2", "cluster.mode=ray", *PP2_TP2_UNEVEN)
    compare("pp2_tp2_uneven", got, expected, tmp_path / "pp2_tp2", expected_hf)
    # MoE: pp=2 x ep=2 (dp=2: the micro-batch count per rank differs) under the interleaved schedule,
    # routes replayed, with a rollout worker of its own: each training rank sends what it owns (its
    # two stages' dense tensors, its EP rank's experts), as `weight_layouts` describes them.
    moe = ["algorithm.routing_replay=rollout", "train.share_prompts=false"]
    expected = train(four_layer_moe_checkpoint, tmp_path / "moe_one", *moe)
    layout = ["cluster.mode=ray", "cluster.num_workers=4", "parallel.pp=2", "parallel.ep=2"]
    layout += ["parallel.pp_schedule=interleaved", "parallel.pp_virtual_stages=2"]
    layout += ["cluster.placement=separate", "cluster.rollout_workers=1"]
    got = train(four_layer_moe_checkpoint, tmp_path / "pp2_ep2", *moe, *layout)
    assert {"moe/load_max_over_mean", "moe/route_mismatch_frac"} <= got[-1].keys()
    compare("pp2_ep2_interleaved", got, expected, tmp_path / "pp2_ep2", hf_export(tmp_path / "moe_one"))


def compare(name: str, got: list[dict], expected: list[dict], run_dir: Path, expected_hf: dict) -> None:
    assert [r["step"] for r in got] == [1, 2], name
    for want, row in zip(expected, got):
        assert want.keys() == row.keys(), name
        for k in want.keys() - {"train/num_micro_batches"}:
            assert row[k] == pytest.approx(want[k], rel=1e-4, abs=1e-6), (name, row["step"], k)
    # The final export holds full tensors (every stage's, TP shards and EP experts gathered): the
    # one-process weights within what two Adam steps at lr 3e-2 turn rounding into (a wrong one moves ~lr).
    exported = hf_export(run_dir)
    assert exported.keys() == expected_hf.keys(), name
    for k, t in expected_hf.items():
        torch.testing.assert_close(exported[k], t, atol=1e-3, rtol=0, msg=lambda m, k=k: f"{name} {k}: {m}")
