"""The engine's micro-batched gradients equal one full-batch computation, for every aggregation
mode and token budget; its logprobs equal a plain full forward of the model."""

from __future__ import annotations

import pytest
import torch
from train_engine_helpers import PolicyLoss, load_tiny, make_batch, make_tiny_checkpoint

from rlloom.algorithms.losses import AGG_MODES, aggregate_loss, loss_normalizer
from rlloom.config import TrainEngineConfig
from rlloom.engines.train.base import ForwardOptions
from rlloom.engines.train.native import NativeTrainEngine


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def reference_logprobs(model, batch, temperature=1.0):
    """log_softmax of the model's padded full forward at the response positions: [B, T]."""
    padded = batch.padded()
    logits = model(padded.input_ids_BL, attention_mask=padded.attention_mask_BL).float() / temperature
    logp_BLV = logits.log_softmax(-1)
    logp_BL = logp_BLV.gather(-1, padded.target_ids_BL[..., None]).squeeze(-1)
    logp_BT = logp_BL.reshape(-1)[padded.gather_index_BT]
    return torch.where(padded.response_mask_BT, logp_BT, torch.zeros_like(logp_BT))


def assert_grad_close(actual, expected, what):
    # fp32 sums in another order: 1e-6 of the gradient's scale (or absolute below scale 1).
    err = (actual - expected).abs().max().item()
    assert err <= 1e-6 * max(1.0, expected.abs().max().item()), f"{what}: max error {err}"


def test_forward_logprobs_match_full_forward(ckpt):
    batch = make_batch(6, seed=1)
    engine = NativeTrainEngine(TrainEngineConfig(max_tokens_per_micro_batch=30), load_tiny(ckpt))
    ref = reference_logprobs(load_tiny(ckpt), batch, temperature=0.7).detach()
    logp, entropy = engine.forward_logprobs(batch, options=ForwardOptions(temperature=0.7, with_entropy=True))
    assert logp.shape == (6, batch.T) and entropy.shape == (6, batch.T)
    torch.testing.assert_close(logp, ref, atol=1e-5, rtol=0)
    assert (entropy[~batch.response_mask()] == 0).all() and (entropy[batch.response_mask()] > 0).all()


@pytest.mark.parametrize("mode", AGG_MODES)
def test_gradients_equal_full_batch(ckpt, mode):
    batch = make_batch(7, seed=2)
    loss_fn = PolicyLoss(batch, mode)
    reference = load_tiny(ckpt)
    logp_BT = reference_logprobs(reference, batch)
    loss = aggregate_loss(loss_fn.per_token(logp_BT, torch.arange(len(batch))), batch.response_mask(), mode)
    loss.backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    normalizer = loss_normalizer(batch.response_mask(), mode)
    longest = max(s.num_tokens for s in batch.samples)
    # one sequence per micro-batch; everything in one; budgets between (seeded random)
    budgets = [
        1,
        batch.num_tokens,
        *torch.randint(
            longest // 2, batch.num_tokens, (2,), generator=torch.Generator().manual_seed(0)
        ).tolist(),
    ]
    model = load_tiny(ckpt)
    engine = NativeTrainEngine(TrainEngineConfig(), model)
    for budget in budgets:
        engine.cfg.max_tokens_per_micro_batch = budget
        metrics = engine.forward_backward(batch, loss_fn, loss_normalizer=normalizer)
        assert metrics["train/loss"] == pytest.approx(loss.item(), rel=1e-6, abs=1e-6)
        assert metrics["train/response_tokens"] == batch.response_mask().sum()
        for name, p in model.named_parameters():
            assert_grad_close(p.grad, ref_grads[name], f"{mode} budget {budget} {name}")


def test_activation_checkpointing_keeps_gradients(ckpt):
    batch = make_batch(5, seed=3)
    loss_fn = PolicyLoss(batch, "token-mean")
    normalizer = loss_normalizer(batch.response_mask(), "token-mean")
    grads = []
    for ac in ("off", "full", "every_k"):
        model = load_tiny(ckpt)
        engine = NativeTrainEngine(
            TrainEngineConfig(activation_checkpointing=ac, max_tokens_per_micro_batch=40), model
        )
        engine.forward_backward(
            batch, loss_fn, loss_normalizer=normalizer, options=ForwardOptions(with_entropy=True)
        )
        grads.append(
            {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()}
        )
    for other in grads[1:]:
        for name, g in grads[0].items():
            torch.testing.assert_close(other[name], g, atol=1e-7, rtol=0)
