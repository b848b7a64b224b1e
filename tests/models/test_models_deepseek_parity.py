"""DeepSeek-V3 (MLA, YaRN with mscale, group-limited sigmoid routing, shared experts) against transformers.

Configs with and without q_lora_rank, interleaved and plain RoPE; logits must match the HF model in
fp32 (<= 1e-4) for padded and packed inputs; expert counts must match HF's router; multi-token
prediction layers in the checkpoint are skipped with a log line.
"""

from __future__ import annotations

import logging

import pytest
import torch
from models_testutil import assert_close, hf_logits_per_sequence, lengths_to_packed, randomize_, right_pad
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

import rlloom.models as models

VOCAB = 100
LENGTHS = [12, 3, 21, 7]
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
    "beta_fast": 32,
    "beta_slow": 1,
}


def _config(q_lora_rank, interleave):
    return DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        n_shared_experts=2,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=3,
        routed_scaling_factor=2.5,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=12,
        max_position_embeddings=256,
        rope_scaling=YARN,
        rope_interleave=interleave,
    )


CASES = {"q_lora_interleaved": (24, True), "no_q_lora_plain_rope": (None, False)}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    torch.manual_seed(0)
    hf = randomize_(DeepseekV3ForCausalLM(_config(*CASES[request.param])).eval(), seed=11)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, models.from_pretrained(path), path


def test_padded_logits_match_hf(pair):
    hf, ours, _ = pair
    seqs, *_ = lengths_to_packed(LENGTHS, VOCAB, seed=12)
    ids, mask = right_pad(seqs)
    with torch.no_grad():
        expected = hf(ids, attention_mask=mask.long()).logits
        actual = ours(ids, attention_mask=mask)
    assert_close(actual[mask], expected[mask])


def test_packed_logits_and_expert_counts_match_hf(pair):
    hf, ours, _ = pair
    seqs, ids, positions, cu = lengths_to_packed(LENGTHS, VOCAB, seed=13)
    chosen = {}
    hooks = [
        layer.mlp.gate.register_forward_hook(
            lambda _m, _i, out, i=i: chosen.__setitem__(
                i, chosen.get(i, 0) + torch.bincount(out[2].flatten(), minlength=8)
            )
        )
        for i, layer in enumerate(hf.model.layers)
        if i >= 1
    ]
    expected = hf_logits_per_sequence(hf, seqs)
    for h in hooks:
        h.remove()
    with torch.no_grad():
        actual = ours(ids, position_ids=positions, cu_seqlens=cu)
    assert_close(actual, expected)
    counts = ours.moe_token_counts()
    assert sorted(counts) == [1, 2]
    for layer, c in counts.items():
        assert torch.equal(c, chosen[layer]), layer


def test_mtp_layers_are_skipped(pair, tmp_path, caplog):
    hf, ours, path = pair
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(32, 64)
    tensors["model.layers.3.self_attn.kv_a_layernorm.weight"] = torch.ones(16)
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with caplog.at_level(logging.INFO, logger="rlloom.models.adapter"):
        loaded = models.from_pretrained(tmp_path)
    assert "skipped 2 multi-token-prediction tensors" in caplog.text
    ids = torch.randint(0, VOCAB, (1, 6))
    with torch.no_grad():
        assert torch.equal(loaded(ids), ours(ids))


def test_fused_projections_load_and_match(pair):
    """The rollout layout of DeepSeek-V3 (fused gate/up in the dense layers; MLA stays as it is)."""
    _, ours, path = pair
    fused = models.from_pretrained(path, fused_projections=True)
    seqs, ids, positions, cu = lengths_to_packed(LENGTHS, VOCAB, seed=13)
    with torch.no_grad():
        kw = dict(position_ids=positions, cu_seqlens=cu, max_seqlen=max(LENGTHS))
        assert_close(fused(ids, **kw), ours(ids, **kw))
    assert sorted(n for n, _ in models.hf_named_tensors(fused)) == sorted(
        n for n, _ in models.hf_named_tensors(ours)
    )
