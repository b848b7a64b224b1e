"""Shared-prompt ("prefix tree") packing is exact: the tree layout, the tree attention kernel, the
model on a tree stream against each sequence run alone, group-unit planning, and the engine's
logprobs and gradients with share_prompts on against off."""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch
from transformers import DeepseekV3Config, Qwen3Config

from rlloom.algorithms.losses import loss_normalizer
from rlloom.config import TrainEngineConfig
from rlloom.data.types import RolloutBatch, Sample
from rlloom.engines.train.base import ForwardOptions
from rlloom.engines.train.native import NativeTrainEngine
from rlloom.engines.train.native.microbatch import shared_prompt_units
from rlloom.models import CausalLM, ModelArgs, attention_ops

VOCAB = 64


def grouped_batch(seed: int, num_groups: int = 6) -> RolloutBatch:
    """Groups of 1..5 samples with shared prompts, some empty responses, some groups whose prompts
    differ between members, shuffled so a group's samples are not adjacent."""
    rng = random.Random(seed)
    samples = []
    for g in range(num_groups):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))]
        differ = rng.random() < 0.25
        for _ in range(rng.randint(1, 5)):
            p = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))] if differ else prompt
            response = [rng.randrange(VOCAB) for _ in range(rng.choice([0, *range(1, 16)]))]
            mask = [int(rng.random() > 0.2) for _ in response]
            samples.append(Sample(prompt_ids=p, response_ids=response, loss_mask=mask, group_id=g))
    rng.shuffle(samples)
    return RolloutBatch(samples)


def lively(model: CausalLM, seed: int) -> CausalLM:
    """Weights with O(1) logits (HF init is nearly zero, which would hide attention errors)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else noise / math.sqrt(p.shape[-1]))
    return model


def dense_model(seed: int = 0) -> CausalLM:
    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    return lively(CausalLM(ModelArgs.from_hf_config(cfg.to_dict())), seed)


def mla_model(seed: int = 0) -> CausalLM:
    cfg = DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        first_k_dense_replace=2,
        num_attention_heads=4,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
    )
    return lively(CausalLM(ModelArgs.from_hf_config(cfg.to_dict())), seed)


# ---- layout -------------------------------------------------------------------------------------


def test_docstring_example():
    batch = RolloutBatch(
        [Sample(prompt_ids=[5, 6], response_ids=[7]), Sample(prompt_ids=[5, 6], response_ids=[8, 9])]
    )
    p = batch.packed(share_prompts=True)
    assert p.input_ids_N.tolist() == [5, 6, 7, 8, 9] and p.position_ids_N.tolist() == [0, 1, 2, 2, 3]
    assert p.cu_seqlens.tolist() == [0, 5] and p.prefix_lens_S.tolist() == [2]
    assert p.branch_lens_Z.tolist() == [1, 2] and p.gather_index_BT.tolist() == [[1, 0], [1, 3]]
    assert p.target_ids_BT.tolist() == [[7, 0], [8, 9]]


@pytest.mark.parametrize("seed", range(4))
def test_tree_layout_gathers_the_predicting_position(seed):
    batch = grouped_batch(seed)
    p = batch.packed(share_prompts=True)
    groups = batch.shared_prompt_groups()
    assert len(p.cu_seqlens) - 1 == len(groups) == len(p.prefix_lens_S)
    saved = sum(len(batch.samples[g[0]].prompt_ids) * (len(g) - 1) for g in groups)
    assert p.input_ids_N.numel() == batch.num_tokens - saved
    for b, s in enumerate(batch.samples):
        for t, tok in enumerate(s.response_ids):
            pos = p.gather_index_BT[b, t].item()
            assert p.target_ids_BT[b, t].item() == tok
            # the predicting position holds the previous token of this sample, at its own position id
            assert p.input_ids_N[pos].item() == s.token_ids[len(s.prompt_ids) + t - 1]
            assert p.position_ids_N[pos].item() == len(s.prompt_ids) + t - 1
    assert torch.equal(p.response_mask_BT, batch.response_mask())
    seq = batch.packed()
    assert torch.equal(seq.target_ids_BT, p.target_ids_BT)
    assert torch.equal(
        seq.target_ids_N[seq.gather_index_BT][seq.response_mask_BT], seq.target_ids_BT[seq.response_mask_BT]
    )


# ---- kernel and model ---------------------------------------------------------------------------


def test_tree_kernel_equals_naive_masked_attention():
    torch.manual_seed(0)
    cu = torch.tensor([0, 7, 20, 23], dtype=torch.int32)
    prefix, branches = (
        torch.tensor([7, 4, 2]),
        torch.tensor([3, 1, 5, 1]),
    )  # segments: 1 prompt-only, 3 + 1 branches
    lens = [7, 4, 3, 1, 5, 2, 1]  # prompt / branch runs in stream order
    run_L = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    seg_of_run = torch.tensor([0, 1, 1, 1, 1, 2, 2])
    is_prompt = torch.tensor([1, 1, 0, 0, 0, 1, 0], dtype=torch.bool)
    qi, kj = torch.arange(23)[:, None], torch.arange(23)[None, :]
    same_seg = seg_of_run[run_L][:, None] == seg_of_run[run_L][None, :]
    visible = same_seg & (kj <= qi) & (is_prompt[run_L][None, :] | (run_L[:, None] == run_L[None, :]))
    q, k, v = torch.randn(23, 8, 16), torch.randn(23, 2, 16), torch.randn(23, 2, 12)
    scores = torch.einsum("nhd,mhd->hnm", q, k.repeat_interleave(4, dim=1)) * 0.3
    probs = scores.masked_fill(~visible, -math.inf).softmax(-1)
    expected = torch.einsum("hnm,mhd->nhd", probs, v.repeat_interleave(4, dim=1))
    tree = attention_ops.TreePlan(cu, prefix, branches)
    assert [m is None for m in tree.masks()] == [True, False, True]
    torch.testing.assert_close(attention_ops.tree_attention(q, k, v, 0.3, tree), expected, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="not its prompt plus whole"):
        attention_ops.TreePlan(cu, prefix, torch.tensor([3, 2, 5, 1]))
    if torch.cuda.is_available():  # the bf16 varlen kernel (needs equal q/v head dims)
        v = torch.randn(23, 2, 16)
        expected = torch.einsum("hnm,mhd->nhd", probs, v.repeat_interleave(4, dim=1))
        tree = attention_ops.TreePlan(cu.cuda(), prefix.cuda(), branches.cuda())
        q, k, v = (x.cuda().bfloat16() for x in (q, k, v))
        actual = attention_ops.tree_attention(q, k, v, 0.3, tree).float().cpu()
        torch.testing.assert_close(actual, expected, atol=3e-2, rtol=0)


@pytest.mark.parametrize("build", [dense_model, mla_model], ids=["dense", "mla"])
@torch.no_grad()
def test_model_tree_equals_each_sequence_alone(build):
    model = build().eval()
    batch = grouped_batch(7, num_groups=4)
    p = batch.packed(share_prompts=True)
    logits_NV = model(
        p.input_ids_N,
        position_ids=p.position_ids_N,
        cu_seqlens=p.cu_seqlens,
        prefix_lens=p.prefix_lens_S,
        branch_lens=p.branch_lens_Z,
    )
    for b, s in enumerate(batch.samples):
        alone_LV = model(torch.tensor(s.token_ids))
        num_prompt, r = len(s.prompt_ids), len(s.response_ids)
        # response logits at the gathered positions; prompt logits at the start of the sample's segment
        expected = alone_LV[num_prompt - 1 : num_prompt - 1 + r]
        torch.testing.assert_close(logits_NV[p.gather_index_BT[b, :r]], expected, atol=1e-5, rtol=0)
        if r:
            seg = int(torch.searchsorted(p.cu_seqlens, p.gather_index_BT[b, 0].int(), right=True)) - 1
            start = int(p.cu_seqlens[seg])
            torch.testing.assert_close(
                logits_NV[start : start + num_prompt], alone_LV[:num_prompt], atol=1e-5, rtol=0
            )


# ---- planning -----------------------------------------------------------------------------------


@pytest.mark.parametrize("budget", [1, 10, 25, 60, 10_000])
def test_units_cover_every_sample_within_budget(budget):
    batch = grouped_batch(3, num_groups=10)
    prompt_lens = [len(s.prompt_ids) for s in batch.samples]
    response_lens = [len(s.response_ids) for s in batch.samples]
    groups = batch.shared_prompt_groups()
    units, unit_tokens = shared_prompt_units(groups, prompt_lens, response_lens, budget)
    assert sorted(i for u in units for i in u) == list(range(len(batch)))
    group_of = {i: g for g, members in enumerate(groups) for i in members}
    for unit, tokens in zip(units, unit_tokens):
        assert len({group_of[i] for i in unit}) == 1
        assert tokens == prompt_lens[unit[0]] + sum(response_lens[i] for i in unit)
        assert tokens <= budget or len(unit) == 1
    if budget == 10_000:
        assert len(units) == len(groups)


# ---- engine: on equals off ----------------------------------------------------------------------


def _engines(budget: int) -> tuple[NativeTrainEngine, NativeTrainEngine]:
    model = dense_model(seed=1)
    on = NativeTrainEngine(TrainEngineConfig(max_tokens_per_micro_batch=budget), copy.deepcopy(model))
    off = NativeTrainEngine(
        TrainEngineConfig(max_tokens_per_micro_batch=budget, share_prompts=False), copy.deepcopy(model)
    )
    return on, off


def _budgets(batch: RolloutBatch) -> list[int]:
    longest = max(s.num_tokens for s in batch.samples)
    return [1, longest + 7, batch.num_tokens]


def test_forward_logprobs_on_equals_off():
    batch = grouped_batch(11)
    for budget in _budgets(batch):
        on, off = _engines(budget)
        logp_on, ent_on = on.forward_logprobs(
            batch, options=ForwardOptions(temperature=0.8, with_entropy=True)
        )
        logp_off, ent_off = off.forward_logprobs(
            batch, options=ForwardOptions(temperature=0.8, with_entropy=True)
        )
        torch.testing.assert_close(logp_on, logp_off, atol=1e-5, rtol=0, msg=f"budget {budget}")
        torch.testing.assert_close(ent_on, ent_off, atol=1e-5, rtol=0, msg=f"budget {budget}")


class _Loss:
    """Per-token policy-gradient loss with a k2 term, aggregated with `mode`."""

    def __init__(self, batch: RolloutBatch, mode: str) -> None:
        from rlloom.algorithms.losses import aggregate_loss_sum

        gen = torch.Generator().manual_seed(0)
        self.mask_BT, self.mode, self.aggregate = batch.response_mask(), mode, aggregate_loss_sum
        self.adv_B = torch.randn(len(batch), generator=gen)
        self.old_BT = -torch.rand(len(batch), batch.T, generator=gen) * 4

    def __call__(self, logp_bT, entropy_bT, rows):
        loss_bT = -self.adv_B[rows, None] * logp_bT + 0.5 * (logp_bT - self.old_BT[rows]) ** 2
        return self.aggregate(loss_bT, self.mask_BT[rows], self.mode), {}


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_gradients_on_equal_off(mode):
    batch = grouped_batch(12)
    loss_fn = _Loss(batch, mode)
    normalizer = loss_normalizer(batch.response_mask(), mode)
    for budget in _budgets(batch):
        on, off = _engines(budget)
        m_on = on.forward_backward(batch, loss_fn, loss_normalizer=normalizer)
        m_off = off.forward_backward(batch, loss_fn, loss_normalizer=normalizer)
        assert m_on["train/loss"] == pytest.approx(m_off["train/loss"], rel=1e-6, abs=1e-6)
        if budget >= max(s.num_tokens for s in batch.samples):
            assert m_on["train/computed_tokens"] < m_off["train/computed_tokens"] == batch.num_tokens
        for (name, p_on), p_off in zip(on.model.named_parameters(), off.model.parameters()):
            scale = max(1.0, p_off.grad.abs().max().item())
            err = (p_on.grad - p_off.grad).abs().max().item()
            assert err <= 1e-5 * scale, f"{mode} budget {budget} {name}: max error {err}"
