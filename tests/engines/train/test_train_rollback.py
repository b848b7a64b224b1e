"""A step whose new parameters are not finite is rolled back, parameters and optimizer state (one
process, and two FSDP ranks on gloo); a non-finite engine refuses to save."""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from procs import free_port, spawn
from test_train_fsdp_gloo import full_weights
from train_engine_helpers import PolicyLoss, load_tiny, make_batch, make_tiny_checkpoint

from rlloom.algorithms.losses import loss_normalizer
from rlloom.config import TrainEngineConfig
from rlloom.engines.train.native import NativeTrainEngine


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def step(engine, batch):
    loss = PolicyLoss(batch, "token-mean")
    return engine.train_step(
        batch, loss, loss_normalizer=loss_normalizer(batch.response_mask(), "token-mean")
    )


def snapshot(engine) -> dict[str, torch.Tensor]:
    """This rank's parameters (shards), CPU master copies and optimizer state."""
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t
    out = {f"param.{n}": local(p.detach()).clone() for n, p in engine.module.named_parameters()}
    for _, _, master in engine.optimizer.offloaded:
        out[f"master.{len(out)}"] = master.detach().clone()
    for i, optim in enumerate(engine.optimizer.optimizers):
        for j, state in enumerate(optim.state.values()):
            out |= {f"optim{i}.{j}.{k}": local(v).clone() for k, v in state.items()}
    return out


def assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


# lr 1e39 is a finite float but inf in fp32: the loss and gradient norm are finite, the update is not.
@pytest.mark.parametrize("offload", [False, True])
def test_non_finite_update_is_rolled_back(ckpt, offload):
    cfg = TrainEngineConfig(
        lr=1e39, weight_decay=0.1, optimizer_offload=offload, optimizer_offload_fraction=0.4
    )
    engine = NativeTrainEngine(cfg, load_tiny(ckpt))
    batch = make_batch(6, seed=4)
    initial = snapshot(engine)

    # First step: the optimizer has no state yet, and must have none after the rollback.
    m = step(engine, batch)
    assert m["train/skipped_step"] == 1.0 and math.isfinite(m["train/grad_norm"]) and m["train/grad_norm"] > 0
    assert engine.version == 0 and engine.num_skipped_steps == 1
    assert_equal(snapshot(engine), initial)

    # After a good step the optimizer has state; a bad step restores it exactly.
    engine.cfg = dataclasses.replace(cfg, lr=1e-3)
    assert step(engine, batch)["train/skipped_step"] == 0.0 and engine.version == 1
    good = snapshot(engine)
    assert any(k.startswith("optim") for k in good)
    assert not torch.equal(
        good["param.model.tok_embeddings.weight"], initial["param.model.tok_embeddings.weight"]
    )
    engine.cfg = dataclasses.replace(cfg, lr=1e39)
    assert step(engine, batch)["train/skipped_step"] == 1.0 and engine.version == 1
    assert_equal(snapshot(engine), good)


def test_non_finite_engine_refuses_to_save(ckpt, tmp_path: Path):
    engine = NativeTrainEngine(TrainEngineConfig(lr=1e-3), load_tiny(ckpt))
    with torch.no_grad():
        next(engine.module.parameters())[0, 0] = float("nan")
    with pytest.raises(ValueError, match="refusing to save a checkpoint .* not finite"):
        engine.save(str(tmp_path / "engine"))
    assert not (tmp_path / "engine").exists()


def sharded_rollback_worker(rank: int, port: int, ckpt: str) -> None:
    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": "2"}
    try:
        cfg = TrainEngineConfig(lr=1e-3, optimizer_offload=True, optimizer_offload_fraction=0.5)
        engine = NativeTrainEngine(cfg, load_tiny(ckpt))
        assert engine.sharded and engine.dp_size == 2
        batch = make_batch(6, seed=4)
        step(engine, batch)
        good = snapshot(engine) | full_weights(engine)
        engine.cfg = dataclasses.replace(cfg, lr=1e39)
        assert step(engine, batch)["train/skipped_step"] == 1.0 and engine.version == 1
        assert_equal(snapshot(engine) | full_weights(engine), good)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.slow
def test_non_finite_update_is_rolled_back_on_every_fsdp_rank(ckpt):
    spawn(sharded_rollback_worker, args=(free_port(), ckpt), nprocs=2, join=True)
