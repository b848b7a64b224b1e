"""LoRA (train.lora_rank) as a user runs it: `rlloom train` trains the adapters only (the base
weights of the checkpoint stay the starting model's), the rollout runs the merged weights (its
logprobs equal the trainer's at every step; without the merge the gap is ~0.1 at step 2), the
run's Hugging Face folder holds W + (alpha / r) B A and loads in transformers, and a resumed run
equals the uninterrupted one. A learning rate that changes the samples, a reward that varies."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_trainer_loop import assert_same_tensors, read_metrics, run_straight_and_resumed, tiny_args

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engines" / "train"))
from train_engine_helpers import PolicyLoss, make_batch  # noqa: E402

from rlloom.algorithms.losses import loss_normalizer
from rlloom.cli import main
from rlloom.config import TrainEngineConfig
from rlloom.engines.train.native import NativeTrainEngine
from rlloom.models import from_pretrained
from rlloom.trainer.checkpoint import checkpoint_dir, checkpoint_model_tensors

LORA = [
    "train.lora_rank=4",
    "train.lora_alpha=8",
    "train.lr=3e-2",
    "reward.name=resume_reward:digit_share",
    f"reward.import_dir={Path(__file__).parent}",
    "reward.num_workers=1",
    "data.num_eval=0",
]


def test_lora_trains_adapters_syncs_merged_weights_and_exports_them(tiny_checkpoint, tmp_path):
    run_dir = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "arithmetic_smoke",
                # save_every: a full last checkpoint (the engine's state, the adapters apart)
                *tiny_args(tiny_checkpoint, run_dir, *LORA, "trainer.total_steps=3", "trainer.save_every=3"),
            ]
        )
        == 0
    )
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len({r["reward/mean"] for r in rows}) > 1  # the samples change
    for row in rows:  # the rollout decodes with the merged weights the trainer computes with
        assert row["rollout/logp_gap_abs"] < 1e-5, row["step"]
    saved = checkpoint_model_tensors(checkpoint_dir(run_dir, 3))
    base = from_pretrained(tiny_checkpoint).state_dict()
    adapters = {k for k in saved if k.endswith(("lora_A", "lora_B"))}
    assert len(adapters) == 2 * 7 * 2  # 2 layers x 7 projections x (A, B)
    assert all(torch.equal(saved[k], base[k]) for k in base)  # the base stays frozen
    assert all(saved[k].abs().max() > 0 for k in adapters)  # B moved; A was never zero
    # the run's Hugging Face folder: merged weights under transformers' names, no adapters
    (hf,) = sorted((run_dir / "hf").iterdir())[-1:]
    exported = load_file(hf / "model.safetensors")
    assert not any("lora" in k for k in exported)
    a, b = saved["layers.1.feed_forward.w2.lora_A"], saved["layers.1.feed_forward.w2.lora_B"]
    merged = base["layers.1.feed_forward.w2.weight"] + (8 / 4) * b @ a
    torch.testing.assert_close(
        exported["model.layers.1.mlp.down_proj.weight"].float(), merged, atol=1e-6, rtol=0
    )
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(hf) is not None


def test_lora_resumes_exactly(tiny_checkpoint, tmp_path):
    straight, resumed = run_straight_and_resumed(tiny_checkpoint, tmp_path, *LORA)
    assert read_metrics(resumed) == read_metrics(straight)
    tensors = lambda run_dir: checkpoint_model_tensors(checkpoint_dir(run_dir, 3))  # noqa: E731
    assert_same_tensors(tensors(straight), tensors(resumed))


def test_one_device_keeps_the_frozen_base_in_the_compute_dtype(tiny_checkpoint):
    # bf16 compute on one device (as on a GPU): the frozen weights are used as they are, in bf16,
    # with no fp32 master and no per-step copy; the adapters keep fp32 masters and AdamW
    config = TrainEngineConfig(lr=3e-2, lora_rank=4, lora_alpha=8.0)
    engine = NativeTrainEngine(config, from_pretrained(tiny_checkpoint), dtype=torch.bfloat16)
    dtypes = {n: p.dtype for n, p in engine.module.named_parameters()}
    assert {d for n, d in dtypes.items() if "lora_" in n} == {torch.float32}
    assert {d for n, d in dtypes.items() if "lora_" not in n} == {torch.bfloat16}
    batch = make_batch(4, seed=3)
    normalizer = loss_normalizer(batch.response_mask(), "token-mean")
    for _ in range(2):
        metrics = engine.train_step(batch, PolicyLoss(batch, "token-mean"), loss_normalizer=normalizer)
        assert metrics["train/skipped_step"] == 0.0
    wq = engine.model.layers[0].attention.wq
    assert wq.lora_B.abs().max() > 0
    merged = {n: t for bucket in engine.named_weights() for n, t in bucket}
    # merged in the weight's dtype (B and A in bf16 as the forward uses them, one rounding): the fp32
    # merge within bf16's precision (the update itself is ~lr = 3e-2)
    got = merged["model.layers.0.self_attn.q_proj.weight"]
    expected = wq.weight.float() + wq.scaling * wq.lora_B @ wq.lora_A
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.detach(), atol=1e-3, rtol=1.6e-2)


# every sample fits the budget the pipeline pads each micro-batch to
PARALLEL = [
    *LORA,
    "trainer.total_steps=2",
    "train.max_tokens_per_micro_batch=160",
    "data.max_prompt_length=150",
]


@pytest.fixture(scope="module")
def one_process(tiny_checkpoint, tmp_path_factory) -> list[dict]:
    """The one-process LoRA run every parallel layout is compared with (run once for all of them)."""
    run_dir = tmp_path_factory.mktemp("lora_one")
    assert main(["train", "arithmetic_smoke", *tiny_args(tiny_checkpoint, run_dir, *PARALLEL)]) == 0
    return read_metrics(run_dir)


@pytest.mark.parametrize(
    "layout",
    [
        # the adapters laid out like their column- and row-parallel weights, the merged weights
        # synced from the TP shards
        "parallel.tp=2",
        # each stage merges its own adapted weights and broadcasts them to the other pp rank; the
        # frozen tied embedding's gradient is not exchanged
        "parallel.pp=2",
    ],
)
def test_lora_in_a_parallel_layout_on_ray_matches_one_process(
    ray_cluster, one_process, tiny_checkpoint, tmp_path, layout
):
    """Two colocated Ray workers: every step's metrics equal the one-process LoRA run's, and the
    rollout decodes with what the trainer computes with."""
    ray = ["cluster.mode=ray", "cluster.num_workers=2", layout]
    assert (
        main(["train", "arithmetic_smoke", *tiny_args(tiny_checkpoint, tmp_path / "ray", *PARALLEL, *ray)])
        == 0
    )
    want, got = one_process, read_metrics(tmp_path / "ray")
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2]
    assert want[0]["reward/mean"] != want[1]["reward/mean"]  # the samples change
    for a, b in zip(want, got):
        skip = {k for k in a if k.startswith("sync/")}  # the transport's pieces differ
        assert a.keys() == b.keys()
        for k in a.keys() - skip:
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), (b["step"], k)
        assert b.get("rollout/logp_gap_abs", 0.0) < 1e-5
