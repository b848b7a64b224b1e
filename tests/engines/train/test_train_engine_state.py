"""Engine state handling: offload/onload round trip, NaN guard, CPU optimizer offload, LR schedules,
weight export under Hugging Face names, and clear errors."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file
from train_engine_helpers import PolicyLoss, load_tiny, make_batch, make_tiny_checkpoint

from rlloom.algorithms.losses import loss_normalizer
from rlloom.config import TrainEngineConfig
from rlloom.engines.train.native import NativeTrainEngine
from rlloom.engines.train.native.lr_schedule import lr_at
from rlloom.weight_sync.checksum import digest


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def step(engine, batch, **kwargs):
    return engine.train_step(
        batch,
        PolicyLoss(batch, "token-mean"),
        loss_normalizer=loss_normalizer(batch.response_mask(), "token-mean"),
        **kwargs,
    )


def params(engine):
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def optim_state(engine):
    out = {}
    for optim in engine.optimizer.optimizers:
        for i, state in enumerate(optim.state.values()):
            out |= {f"{id(optim)}.{i}.{k}": v.clone() for k, v in state.items()}
    return out


def test_offload_onload_round_trip_and_nan_guard(ckpt):
    engine = NativeTrainEngine(
        TrainEngineConfig(lr=1e-3, weight_decay=0.1, max_tokens_per_micro_batch=50), load_tiny(ckpt)
    )
    batch = make_batch(6, seed=4)
    step(engine, batch)
    before_p, before_s = params(engine), optim_state(engine)
    engine.offload()
    engine.onload()
    for d_before, d_after in ((before_p, params(engine)), (before_s, optim_state(engine))):
        assert d_before.keys() == d_after.keys()
        for k in d_before:
            assert torch.equal(d_before[k], d_after[k]), k

    def nan_loss(logp_bT, entropy_bT, rows):
        return logp_bT.sum() * float("nan"), {}

    metrics = engine.train_step(batch, nan_loss, loss_normalizer=1.0)
    assert metrics["train/skipped_step"] == 1.0 and math.isnan(metrics["train/loss"])
    assert engine.version == 1 and engine.num_skipped_steps == 1
    for k, v in params(engine).items():
        assert torch.equal(v, before_p[k]), k
    assert step(engine, batch)["train/skipped_step"] == 0.0 and engine.version == 2


@pytest.mark.parametrize("fraction", [0.4, 1.0])
def test_optimizer_offload_matches_device_step(ckpt, fraction):
    batch = make_batch(5, seed=5)
    cfg = dict(lr=1e-3, weight_decay=0.05, grad_clip=0.5)
    plain = NativeTrainEngine(TrainEngineConfig(**cfg), load_tiny(ckpt))
    offload = NativeTrainEngine(
        TrainEngineConfig(**cfg, optimizer_offload=True, optimizer_offload_fraction=fraction), load_tiny(ckpt)
    )
    assert offload.optimizer.offloaded and (offload.optimizer.device_optim is None) == (fraction == 1.0)
    for _ in range(2):
        m_plain, m_off = step(plain, batch), step(offload, batch)
        assert m_plain["train/grad_norm"] == m_off["train/grad_norm"]
    p_plain, p_off = params(plain), params(offload)
    for k in p_plain:
        assert torch.equal(p_plain[k], p_off[k]), k


def test_lr_schedules():
    cos = TrainEngineConfig(lr=1.0, warmup_steps=2, lr_schedule="cosine", min_lr_ratio=0.1)
    assert [lr_at(s, cos, 12) for s in (0, 1, 2)] == [0.5, 1.0, 1.0]
    assert lr_at(7, cos, 12) == pytest.approx(0.55) and lr_at(12, cos, 12) == pytest.approx(0.1)
    lin = TrainEngineConfig(lr=1.0, lr_schedule="linear")
    assert lr_at(5, lin, 10) == 0.5 and lr_at(10, lin, 10) == 0.0
    assert lr_at(99, TrainEngineConfig(lr=2.0), None) == 2.0
    with pytest.raises(ValueError, match="total_steps"):
        lr_at(0, lin, None)


def test_named_weights_are_the_hf_checkpoint(ckpt):
    engine = NativeTrainEngine.build(TrainEngineConfig(), ckpt)
    buckets = list(engine.named_weights(bucket_bytes=30_000))
    assert len(buckets) > 1
    assert all(sum(t.numel() * 4 for _, t in b) <= 30_000 or len(b) == 1 for b in buckets)
    exported = dict(pair for b in buckets for pair in b)
    on_disk = load_file(f"{ckpt}/model.safetensors")
    assert exported.keys() == on_disk.keys()
    for name, t in on_disk.items():
        assert digest(exported[name].to(t.dtype)) == digest(t), name
    assert digest(torch.ones(3)) != digest(torch.ones(3, dtype=torch.float64))
    bf16 = next(iter(engine.named_weights(dtype=torch.bfloat16)))
    assert all(t.dtype == torch.bfloat16 for _, t in bf16)


def test_clear_errors(ckpt):
    engine = NativeTrainEngine(TrainEngineConfig(), load_tiny(ckpt))
    batch = make_batch(2)
    with pytest.raises(ValueError, match="loss_normalizer"):
        step_fn = PolicyLoss(batch, "token-mean")
        engine.train_step(batch, step_fn, loss_normalizer=0.0)
    with pytest.raises(ValueError, match="scalar tensor"):
        engine.train_step(batch, lambda lp, e, rows: (lp.sum(dim=1), {}), loss_normalizer=1.0)
    with pytest.raises(ValueError, match="total_steps"):
        NativeTrainEngine(TrainEngineConfig(lr_schedule="cosine"), load_tiny(ckpt))


def test_micro_batch_without_trained_tokens(ckpt):
    from rlloom.data.types import RolloutBatch, Sample

    engine = NativeTrainEngine(TrainEngineConfig(max_tokens_per_micro_batch=1), load_tiny(ckpt))
    batch = RolloutBatch(
        [
            Sample(prompt_ids=[1, 2], response_ids=[3, 4], loss_mask=[0, 0]),
            Sample(prompt_ids=[5], response_ids=[6, 7]),
        ]
    )
    logp, _ = engine.forward_logprobs(batch)
    assert (logp[0] == 0).all() and (logp[1] < 0).all()
    metrics = step(engine, batch)
    assert metrics["train/num_micro_batches"] == 2 and metrics["train/response_tokens"] == 2
    assert all(p.grad is None for p in engine.module.parameters())  # freed after the step
