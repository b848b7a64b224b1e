"""MoE models (Qwen3-MoE top-1/2/8, dense/sparse layer mixes; Mixtral) against transformers.

Logits must match the HF model in fp32 (<= 1e-4) for padded and packed inputs, and the per-expert
token counts of `moe_token_counts()` must equal the counts of the experts HF's router chose.
"""

from __future__ import annotations

import pytest
import torch
from models_testutil import assert_close, hf_logits_per_sequence, lengths_to_packed, randomize_, right_pad
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

import rlloom.models as models

VOCAB = 120
LENGTHS = [11, 4, 23, 8]
_BASE = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def _qwen3_moe(top_k, num_experts, norm, **extra):
    cfg = Qwen3MoeConfig(
        **_BASE,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=norm,
        **extra,
    )
    return Qwen3MoeForCausalLM, cfg


def _mixtral():
    cfg = MixtralConfig(
        **_BASE, intermediate_size=24, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2
    )
    return MixtralForCausalLM, cfg


CASES = {
    "qwen3moe_top1_e8": lambda: _qwen3_moe(1, 8, False),
    "qwen3moe_top2_e8_norm": lambda: _qwen3_moe(2, 8, True),
    "qwen3moe_top8_e16_sparse_step2": lambda: _qwen3_moe(8, 16, True, decoder_sparse_step=2),
    "qwen3moe_top2_mlp_only_layer0": lambda: _qwen3_moe(2, 8, False, mlp_only_layers=[0]),
    "mixtral_top2_e8": _mixtral,
}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    cls, cfg = CASES[request.param]()
    torch.manual_seed(0)
    hf = randomize_(cls(cfg).eval(), seed=7)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, models.from_pretrained(path)


def _hf_counts(hf, seqs):
    """Per layer, tokens per expert chosen by HF's routers over the sequences run one by one."""
    counts, hooks = {}, []
    for i, layer in enumerate(hf.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is None or not hasattr(gate, "top_k"):
            continue
        num_experts = gate.weight.shape[0]

        def hook(_module, _inputs, output, i=i, num_experts=num_experts):
            chosen = torch.bincount(output[2].flatten(), minlength=num_experts)
            counts[i] = counts.get(i, 0) + chosen

        hooks.append(gate.register_forward_hook(hook))
    hf_logits_per_sequence(hf, seqs)
    for h in hooks:
        h.remove()
    return counts


def test_padded_logits_match_hf(pair):
    hf, ours = pair
    seqs, *_ = lengths_to_packed(LENGTHS, VOCAB, seed=8)
    ids, mask = right_pad(seqs)
    with torch.no_grad():
        expected = hf(ids, attention_mask=mask.long()).logits
        actual = ours(ids, attention_mask=mask)
    assert_close(actual[mask], expected[mask])


def test_packed_logits_and_expert_counts_match_hf(pair):
    hf, ours = pair
    seqs, ids, positions, cu = lengths_to_packed(LENGTHS, VOCAB, seed=9)
    with torch.no_grad():
        actual = ours(ids, position_ids=positions, cu_seqlens=cu)
    assert_close(actual, hf_logits_per_sequence(hf, seqs))
    expected_counts = _hf_counts(hf, seqs)
    counts = ours.moe_token_counts()
    assert counts.keys() == expected_counts.keys() and counts
    for layer, c in counts.items():
        assert torch.equal(c, expected_counts[layer]), layer
        assert int(c.sum()) == sum(LENGTHS) * ours.args.moe.top_k
