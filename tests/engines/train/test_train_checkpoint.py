"""Checkpoints: a run resumed from step 2 is bit-identical to an uninterrupted one (with and
without CPU optimizer offload), and incomplete or damaged folders are refused by name."""

from __future__ import annotations

import os
import random

import pytest
import torch
from train_engine_helpers import PolicyLoss, load_tiny, make_batch, make_tiny_checkpoint

from rlloom.algorithms.losses import loss_normalizer
from rlloom.config.components import TrainEngineConfig
from rlloom.engines.train.native import NativeTrainEngine


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), tie=True)


def step(engine, seed):
    batch = make_batch(5, seed=seed)
    # A loss that draws from the RNG, so a resume must restore the RNG state too.
    noise = torch.rand(()).item() + random.random()
    loss = PolicyLoss(batch, "seq-mean-token-mean")
    engine.train_step(
        batch,
        lambda lp, ent, rows: (loss(lp, ent, rows)[0] * (1 + noise), {}),
        loss_normalizer=loss_normalizer(batch.response_mask(), "seq-mean-token-mean"),
    )


@pytest.mark.parametrize("offload", [False, True])
def test_resume_is_bit_identical(ckpt, tmp_path, offload):
    cfg = TrainEngineConfig(
        lr=1e-3,
        weight_decay=0.1,
        warmup_steps=1,
        lr_schedule="cosine",
        optimizer_offload=offload,
        optimizer_offload_fraction=0.5,
    )
    torch.manual_seed(0)
    random.seed(0)
    straight = NativeTrainEngine(cfg, load_tiny(ckpt), total_steps=4)
    for s in range(2):
        step(straight, s)
    straight.save(str(tmp_path / "ckpt"))
    straight.save(str(tmp_path / "ckpt"))  # overwriting a checkpoint keeps it complete
    step(straight, 2)

    torch.manual_seed(123)  # the fresh engine starts from other RNG states
    random.seed(123)
    resumed = NativeTrainEngine(cfg, load_tiny(ckpt), total_steps=4)
    resumed.load(str(tmp_path / "ckpt"))
    assert resumed.version == 2
    step(resumed, 2)
    for (name, a), (_, b) in zip(straight.module.named_parameters(), resumed.module.named_parameters()):
        assert torch.equal(a, b), name
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_incomplete_checkpoint_is_refused(ckpt, tmp_path):
    engine = NativeTrainEngine(TrainEngineConfig(), load_tiny(ckpt))
    step(engine, 0)
    path = tmp_path / "ckpt"
    engine.save(str(path))
    (path / "rng_rank0.pt").unlink()
    with pytest.raises(ValueError, match="'rng_rank0.pt'.*missing"):
        engine.load(str(path))
    (path / "manifest.json").unlink()
    with pytest.raises(ValueError, match="manifest.json is missing"):
        engine.load(str(path))
