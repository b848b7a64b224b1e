"""MoE router balancing in the training engine: the auxiliary loss against a hand-written Switch loss
and its gradient, DeepSeek-V3's correction-bias update from the step's expert loads, load metrics,
and both options off by default (no change to the router)."""

from __future__ import annotations

import random

import pytest
import torch
from procs import free_port, spawn
from test_train_shared_prompts import lively
from transformers import DeepseekV3Config, Qwen3MoeConfig

from rlloom.algorithms.losses import loss_normalizer
from rlloom.config import ConfigError, TrainEngineConfig
from rlloom.data.types import RolloutBatch, Sample
from rlloom.engines.train.native import NativeTrainEngine
from rlloom.models import CausalLM, ModelArgs
from rlloom.models.moe import load_balancing_loss

VOCAB = 64


def qwen3_moe(seed: int = 0) -> CausalLM:
    cfg = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True,
    )  # fmt: skip
    return lively(CausalLM(ModelArgs.from_hf_config(cfg.to_dict())), seed)


def deepseek(seed: int = 0) -> CausalLM:
    cfg = DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        first_k_dense_replace=1, num_attention_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
        n_shared_experts=1,
    )  # fmt: skip
    return lively(CausalLM(ModelArgs.from_hf_config(cfg.to_dict())), seed)


def batch(seed: int = 0, n: int = 6) -> RolloutBatch:
    rng = random.Random(seed)
    return RolloutBatch(
        [
            Sample(
                prompt_ids=[rng.randrange(VOCAB) for _ in range(rng.randint(2, 8))],
                response_ids=[rng.randrange(VOCAB) for _ in range(rng.randint(2, 10))],
                group_id=i,
            )
            for i in range(n)
        ]
    )


def zero_policy_loss(logp_bT, entropy_bT, rows):
    return (logp_bT * 0.0).sum(), {}


def test_load_balancing_loss_matches_a_loop():
    gen = torch.Generator().manual_seed(0)
    scores_TE = torch.rand(10, 4, generator=gen)
    experts_TK = torch.topk(scores_TE + torch.rand(10, 4, generator=gen), 2).indices
    counts_E = torch.bincount(experts_TK.flatten(), minlength=4)
    want = 0.0
    for e in range(4):
        f = sum(int(e in row) for row in experts_TK.tolist()) / (10 * 2)
        p = sum(float(scores_TE[t, e] / scores_TE[t].sum()) for t in range(10)) / 10
        want += 4 * f * p
    assert abs(float(load_balancing_loss(scores_TE, counts_E, 2)) - want) < 1e-6
    even = torch.full((4, 4), 0.25)
    assert float(load_balancing_loss(even, torch.tensor([2, 2, 2, 2]), 2)) == pytest.approx(1.0)


def test_aux_loss_gradient_equals_the_hand_computed_one():
    """One micro-batch, zero policy loss: the router gradient is exactly coef x d(mean layer aux)."""
    coef = 0.5
    model = qwen3_moe()
    reference = qwen3_moe()
    b = batch()
    cfg = TrainEngineConfig(
        lr=1e-3, max_tokens_per_micro_batch=4096, share_prompts=False, moe_aux_loss_coef=coef
    )
    engine = NativeTrainEngine(cfg, model)
    metrics = engine.forward_backward(b, zero_policy_loss, loss_normalizer=1.0)
    packed = b.packed()
    layer_losses = []  # each layer's loss from its router's output, independent of the engine's path

    def keep_loss(_router, _inputs, out):
        _weights_TK, experts_TK, _own_TK, scores_TE = out
        counts_E = torch.bincount(experts_TK.flatten(), minlength=scores_TE.shape[1])
        layer_losses.append(load_balancing_loss(scores_TE, counts_E, experts_TK.shape[1]))

    for moe in reference.moe_layers().values():
        moe.router.register_forward_hook(keep_loss)
    reference(packed.input_ids_N, position_ids=packed.position_ids_N, cu_seqlens=packed.cu_seqlens)
    aux = torch.stack(layer_losses).mean()
    (coef * aux).backward()
    assert metrics["moe/aux_loss"] == pytest.approx(float(aux.detach()), rel=1e-5)
    for i, moe in engine.model.moe_layers().items():
        want = reference.moe_layers()[i].router.gate.weight.grad
        torch.testing.assert_close(moe.router.gate.weight.grad, want, rtol=1e-5, atol=1e-7)
        assert want.abs().sum() > 0


def test_aux_loss_off_by_default_leaves_the_router_untouched():
    engine = NativeTrainEngine(TrainEngineConfig(lr=1e-2), qwen3_moe())
    before = {i: m.router.gate.weight.detach().clone() for i, m in engine.model.moe_layers().items()}
    metrics = engine.train_step(batch(), zero_policy_loss, loss_normalizer=1.0)
    assert "moe/aux_loss" not in metrics and metrics["moe/load_max_over_mean"] >= 1.0
    for i, m in engine.model.moe_layers().items():
        assert torch.equal(m.router.gate.weight, before[i])
    with_aux = NativeTrainEngine(TrainEngineConfig(lr=1e-2, moe_aux_loss_coef=1.0), qwen3_moe())
    with_aux.train_step(batch(), zero_policy_loss, loss_normalizer=1.0)
    assert any(
        not torch.equal(m.router.gate.weight, before[i]) for i, m in with_aux.model.moe_layers().items()
    )


def test_aux_loss_micro_batches_are_token_weighted():
    """Several micro-batches give the same aux metric as the token-weighted per-micro-batch losses."""
    b = batch(seed=3, n=8)
    one = NativeTrainEngine(TrainEngineConfig(share_prompts=False, moe_aux_loss_coef=1.0), qwen3_moe())
    many = NativeTrainEngine(
        TrainEngineConfig(share_prompts=False, moe_aux_loss_coef=1.0, max_tokens_per_micro_batch=24),
        qwen3_moe(),
    )
    m_one = one.forward_backward(b, zero_policy_loss, loss_normalizer=1.0)
    m_many = many.forward_backward(b, zero_policy_loss, loss_normalizer=1.0)
    assert m_many["train/num_micro_batches"] > 1
    # Not equal to the one-batch value (the loss is not additive over tokens), but a weighted mean of
    # per-micro-batch losses, each >= 1 only at imbalance: same order, different value.
    assert m_many["moe/aux_loss"] != pytest.approx(m_one["moe/aux_loss"], rel=1e-9)
    assert 0.5 < m_many["moe/aux_loss"] < 8.0


def test_correction_bias_moves_against_the_load():
    rate = 0.01
    engine = NativeTrainEngine(TrainEngineConfig(lr=1e-3, moe_bias_update_rate=rate), deepseek())
    (layer, moe), *_ = engine.model.moe_layers().items()
    # Skew the routing: a large bias on expert 0 sends it most tokens (choice = score + bias).
    with torch.no_grad():
        moe.router.expert_bias.zero_()[0] = 5.0
    before = moe.router.expert_bias.clone()
    loads = []
    original = moe.forward

    def spy(*args):
        out = original(*args)
        loads.append(moe.last_token_counts.clone())
        return out

    moe.forward = spy
    metrics = engine.train_step(batch(), zero_policy_loss, loss_normalizer=1.0)
    load_E = torch.stack(loads).sum(0).double()
    want = before + rate * torch.sign(load_E.mean() - load_E).float()
    torch.testing.assert_close(moe.router.expert_bias, want)
    assert moe.router.expert_bias[0] < before[0]  # the overloaded expert's bias falls
    assert metrics[f"moe/layer{layer}_load_max_over_mean"] > 2.0
    assert metrics["moe/bias_abs_mean"] > 0


def test_bias_stays_without_rate_and_on_skipped_steps():
    engine = NativeTrainEngine(TrainEngineConfig(lr=1e-3), deepseek())
    moe = next(iter(engine.model.moe_layers().values()))
    before = moe.router.expert_bias.clone()
    engine.train_step(batch(), zero_policy_loss, loss_normalizer=1.0)
    assert torch.equal(moe.router.expert_bias, before)

    skipping = NativeTrainEngine(TrainEngineConfig(lr=1e-3, moe_bias_update_rate=0.1), deepseek())
    moe = next(iter(skipping.model.moe_layers().values()))
    before = moe.router.expert_bias.clone()
    nan_loss = lambda logp, ent, rows: ((logp * 0.0).sum() + float("nan"), {})
    metrics = skipping.train_step(
        batch(), nan_loss, loss_normalizer=loss_normalizer(batch().response_mask(), "token-mean")
    )
    assert metrics["train/skipped_step"] == 1.0
    assert torch.equal(moe.router.expert_bias, before)


@pytest.mark.parametrize("field", ["moe_aux_loss_coef", "moe_bias_update_rate"])
@pytest.mark.parametrize("value", [-0.1, float("inf"), float("nan")])
def test_bad_router_options_are_refused(field, value):
    with pytest.raises(ConfigError, match=f"train.{field}"):
        TrainEngineConfig(**{field: value})


def _bias_worker(rank: int, port: int, expected: dict) -> None:
    import os

    import torch.distributed as dist

    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": "2"}
    try:
        engine = NativeTrainEngine(TrainEngineConfig(lr=1e-3, moe_bias_update_rate=0.01), deepseek())
        assert engine.dp_size == 2
        metrics = engine.train_step(batch(n=8), zero_policy_loss, loss_normalizer=1.0)
        moe = next(iter(engine.model.moe_layers().values()))
        # Each rank saw half the tokens; the all-reduced loads give the one-process update.
        torch.testing.assert_close(moe.router.expert_bias.cpu(), expected["bias"], rtol=0, atol=0)
        assert metrics["moe/load_max_over_mean"] == pytest.approx(expected["ratio"], rel=1e-9)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_two_ranks_update_the_bias_from_the_global_load():
    single = NativeTrainEngine(TrainEngineConfig(lr=1e-3, moe_bias_update_rate=0.01), deepseek())
    metrics = single.train_step(batch(n=8), zero_policy_loss, loss_normalizer=1.0)
    bias = next(iter(single.model.moe_layers().values())).router.expert_bias.detach().clone()
    assert bias.abs().sum() > 0
    expected = {"bias": bias, "ratio": metrics["moe/load_max_over_mean"]}
    spawn(_bias_worker, args=(free_port(), expected), nprocs=2, join=True)
