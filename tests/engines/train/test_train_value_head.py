"""The critic's engine (head `value`): its values are a plain padded forward's value at the position
before each response token, with shared prompts and any token budget, and its clipped value loss's
gradients equal one full-batch computation of the same loss."""

from __future__ import annotations

import random

import pytest
import torch
from train_engine_helpers import VOCAB, load_tiny, make_tiny_checkpoint, tiny_qwen3_config

from rlloom.algorithms.losses import value_loss
from rlloom.algorithms.objective import make_value_loss_fn, value_normalizer
from rlloom.config import TrainEngineConfig
from rlloom.data.types import RolloutBatch, Sample, ValueUpdate
from rlloom.engines.train.native import NativeTrainEngine


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def ckpt(request, tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), tie=request.param)


def grouped_batch(num_groups: int, group_size: int, *, seed: int) -> RolloutBatch:
    """Groups of samples sharing a prompt (packed behind one copy of it), masks with holes."""
    rng = random.Random(seed)
    samples = []
    for g in range(num_groups):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 9))]
        for _ in range(group_size):
            response = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))]
            mask = [int(rng.random() > 0.2) for _ in response]
            samples.append(Sample(prompt_ids=prompt, response_ids=response, loss_mask=mask, group_id=g))
    return RolloutBatch(samples)


def lively(engine: NativeTrainEngine) -> None:
    """A value head that is not zero (a new one is), so the values depend on the hidden states."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        weight = engine.module.score.weight
        weight.copy_(torch.randn(weight.shape, generator=gen) / weight.shape[1] ** 0.5)  # values ~ N(0, 1)
        engine.module.score.bias.fill_(0.25)


def reference_values(model, score: torch.nn.Linear, batch: RolloutBatch) -> torch.Tensor:
    """score(hidden state) of a padded full forward at the position that predicts each response token."""
    padded = batch.padded()
    hidden_BLD = model.hidden_states(padded.input_ids_BL, attention_mask=padded.attention_mask_BL)
    values_BL = score(hidden_BLD).squeeze(-1).float()
    values_BT = values_BL.reshape(-1)[padded.gather_index_BT]
    return torch.where(padded.response_mask_BT, values_BT, torch.zeros_like(values_BT))


def value_engine(ckpt: str, budget: int, share_prompts: bool = True) -> NativeTrainEngine:
    cfg = TrainEngineConfig(max_tokens_per_micro_batch=budget, share_prompts=share_prompts, lr=1e-3)
    engine = NativeTrainEngine(cfg, load_tiny(ckpt), head="value")
    lively(engine)
    return engine


@pytest.mark.parametrize("share_prompts", [True, False])
@pytest.mark.parametrize("budget", [1, 24, 10_000])
def test_values_match_a_padded_full_forward(ckpt, budget, share_prompts):
    batch = grouped_batch(3, 3, seed=budget)
    engine = value_engine(ckpt, budget, share_prompts)
    assert engine.model.output is None  # the value model drops the vocabulary head
    expected = reference_values(load_tiny(ckpt), engine.module.score, batch).detach()
    values = engine.forward_values(batch)
    assert values.shape == (len(batch), batch.T)
    torch.testing.assert_close(values, expected, atol=1e-5, rtol=0)
    assert values[batch.response_mask()].abs().min() > 0  # values everywhere they are trained
    with pytest.raises(ValueError, match="forward_logprobs needs an engine with head='policy'"):
        engine.forward_logprobs(batch)


def test_a_new_value_head_starts_at_zero(ckpt):
    batch = grouped_batch(2, 2, seed=0)
    engine = NativeTrainEngine(TrainEngineConfig(), load_tiny(ckpt), head="value")
    assert torch.equal(engine.forward_values(batch), torch.zeros(len(batch), batch.T))


@pytest.mark.parametrize("budget", [1, 30, 10_000])
def test_value_loss_gradients_equal_the_full_batch(ckpt, budget):
    batch = grouped_batch(3, 2, seed=7)
    mask_BT = batch.response_mask()
    reference = load_tiny(ckpt)
    engine = value_engine(ckpt, budget)
    score = engine.module.score
    ref_score = torch.nn.Linear(score.in_features, 1)
    ref_score.load_state_dict(score.state_dict())
    values_BT = reference_values(reference, ref_score, batch)
    # old values within ~0.4 of the current ones and a clip of 0.3: both branches of the clip are taken
    gen = torch.Generator().manual_seed(1)
    old_BT = (values_BT.detach() + 0.4 * torch.randn(values_BT.shape, generator=gen)) * mask_BT
    returns_BT = (values_BT.detach() + torch.randn(values_BT.shape, generator=gen)) * mask_BT
    update = ValueUpdate(
        batch=batch, old_values_BT=old_BT, returns_BT=returns_BT, normalizer=value_normalizer(mask_BT)
    )
    clip = 0.3
    loss_BT = value_loss(values_BT, old_BT, returns_BT, mask_BT, clip=clip)
    loss = loss_BT[mask_BT].sum() / mask_BT.sum()
    loss.backward()
    clipped = ((values_BT - old_BT).abs() > clip)[mask_BT].float().mean()
    assert 0.1 < clipped < 0.9

    metrics = engine.forward_backward(
        batch, make_value_loss_fn(update, clip=clip), loss_normalizer=update.normalizer
    )
    assert metrics["train/loss"] == pytest.approx(loss.item(), rel=1e-6)
    ref_grads = {f"model.{n}": p.grad for n, p in reference.named_parameters() if p.grad is not None}
    ref_grads |= {f"score.{n}": p.grad for n, p in ref_score.named_parameters()}
    grads = {n: p.grad for n, p in engine.module.named_parameters()}
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        err = (g - ref_grads[name]).abs().max().item()
        assert err <= 1e-6 * max(1.0, ref_grads[name].abs().max().item()), f"budget {budget} {name}: {err}"


def hf_value_model(path, kind: str, *, labels: int = 1):
    """A tiny transformers value (token classification) or reward (sequence classification) model,
    saved at `path`, with a head that is not zero."""
    from transformers import Qwen3ForSequenceClassification, Qwen3ForTokenClassification

    torch.manual_seed(5)
    cls = Qwen3ForTokenClassification if kind == "token" else Qwen3ForSequenceClassification
    model = cls(tiny_qwen3_config(num_labels=labels)).eval()
    with torch.no_grad():
        model.score.weight.normal_(0, 32**-0.5)
        if model.score.bias is not None:
            model.score.bias.fill_(-0.5)
    model.save_pretrained(path)
    return model


def hf_token_values(hf_model, batch: RolloutBatch) -> torch.Tensor:
    """The score head of a transformers value or reward model at every position that predicts a
    response token (a reward model pools these; a value model reads them all)."""
    padded = batch.padded()
    with torch.no_grad():
        hidden_BLD = hf_model.model(input_ids=padded.input_ids_BL, attention_mask=padded.attention_mask_BL)[0]
        values_BT = hf_model.score(hidden_BLD).squeeze(-1).reshape(-1)[padded.gather_index_BT]
    return torch.where(padded.response_mask_BT, values_BT, torch.zeros_like(values_BT))


@pytest.mark.parametrize("kind", ["token", "sequence"])
def test_a_critic_starts_from_a_value_or_reward_model(tmp_path, kind):
    hf_model = hf_value_model(tmp_path / kind, kind)
    engine = NativeTrainEngine.build(
        TrainEngineConfig(max_tokens_per_micro_batch=40), str(tmp_path / kind), head="value"
    )
    assert torch.equal(engine.module.score.weight, hf_model.score.weight)
    bias = hf_model.score.bias if kind == "token" else torch.zeros(1)  # a reward model's head has no bias
    assert torch.equal(engine.module.score.bias, bias)
    batch = grouped_batch(3, 2, seed=4)
    torch.testing.assert_close(
        engine.forward_values(batch), hf_token_values(hf_model, batch), atol=1e-5, rtol=0
    )


def test_a_value_model_with_two_labels_is_refused(tmp_path):
    hf_value_model(tmp_path / "two", "token", labels=2)
    with pytest.raises(
        ValueError, match=r"score.weight of shape \[2, 32\], but a value model has one output"
    ):
        NativeTrainEngine.build(TrainEngineConfig(), str(tmp_path / "two"), head="value")


def test_the_exported_critic_loads_in_transformers_and_as_a_critic_again(ckpt, tmp_path):
    from transformers import AutoModelForTokenClassification

    from rlloom.engines.train.hf_folder import save_hf_folder

    engine = value_engine(ckpt, 10_000)  # a head that is not zero
    batch = grouped_batch(3, 2, seed=2)
    values = engine.forward_values(batch)
    out = save_hf_folder(engine, ckpt, tmp_path / "critic", critic=True)
    hf_model = AutoModelForTokenClassification.from_pretrained(out).eval()
    assert type(hf_model).__name__ == "Qwen3ForTokenClassification" and hf_model.config.num_labels == 1
    torch.testing.assert_close(hf_token_values(hf_model, batch), values, atol=1e-5, rtol=0)
    again = NativeTrainEngine.build(TrainEngineConfig(max_tokens_per_micro_batch=24), str(out), head="value")
    torch.testing.assert_close(again.forward_values(batch), values, atol=1e-6, rtol=0)
