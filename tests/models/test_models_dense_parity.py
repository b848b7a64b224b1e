"""Dense models (Llama incl. llama3 RoPE scaling, Qwen2 with bias, Qwen3 tied/untied) against transformers.

Each tiny config is built with transformers' own config class, given lively random weights, saved
with save_pretrained and loaded with rlloom.models.from_pretrained; logits must match the HF model
in fp32 (max abs diff <= 1e-4) for a right-padded batch and for a packed stream.
"""

from __future__ import annotations

import pytest
import torch
from models_testutil import assert_close, hf_logits_per_sequence, lengths_to_packed, randomize_, right_pad
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import rlloom.models as models
from rlloom.models.adapter import native_keys
from rlloom.models.layers import FusedLinear

VOCAB = 160
LENGTHS = [13, 5, 29, 1, 18]


def _llama3():
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=500000.0,
        rope_scaling=scaling,
    )
    return LlamaForCausalLM, cfg


def _llama_mha_bias():
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_key_value_heads=3,
        attention_bias=True,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM, cfg


def _qwen2():
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        rope_theta=1e6,
    )
    return Qwen2ForCausalLM, cfg


def _qwen3_tied():
    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=True,
    )
    return Qwen3ForCausalLM, cfg


def _qwen3_untied():
    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=False,
    )
    return Qwen3ForCausalLM, cfg


CASES = {
    "llama3_rope": _llama3,
    "llama_mha_bias_tied": _llama_mha_bias,
    "qwen2_bias_gqa4": _qwen2,
    "qwen3_tied_hd32": _qwen3_tied,
    "qwen3_untied_gqa4_hd8": _qwen3_untied,
}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    cls, cfg = CASES[request.param]()
    torch.manual_seed(0)
    hf = randomize_(cls(cfg).eval(), seed=1)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, models.from_pretrained(path)


def test_padded_logits_match_hf(pair):
    hf, ours = pair
    seqs, *_ = lengths_to_packed(LENGTHS, VOCAB, seed=2)
    ids, mask = right_pad(seqs)
    with torch.no_grad():
        expected = hf(ids, attention_mask=mask.long()).logits
        actual = ours(ids, attention_mask=mask)
    assert actual.shape == expected.shape
    assert_close(actual[mask], expected[mask])
    assert_close(actual[mask], hf_logits_per_sequence(hf, seqs))


def test_packed_logits_match_hf(pair):
    hf, ours = pair
    seqs, ids, positions, cu = lengths_to_packed(LENGTHS, VOCAB, seed=3)
    with torch.no_grad():
        actual = ours(ids, position_ids=positions, cu_seqlens=cu, max_seqlen=max(LENGTHS))
    assert actual.shape == (sum(LENGTHS), VOCAB)
    assert_close(actual, hf_logits_per_sequence(hf, seqs))


def test_args_read_from_config(pair):
    hf, ours = pair
    cfg = hf.config
    assert ours.args.num_layers == cfg.num_hidden_layers
    assert ours.args.num_kv_heads == cfg.num_key_value_heads
    assert ours.args.tie_word_embeddings == cfg.tie_word_embeddings
    assert (ours.output is None) == cfg.tie_word_embeddings


def test_left_padding_is_rejected(pair):
    _, ours = pair
    mask = torch.tensor([[False, True, True]])
    with pytest.raises(ValueError, match="right padding"):
        ours(torch.zeros(1, 3, dtype=torch.long), attention_mask=mask)


def test_fused_projections_are_the_same_model(pair):
    """The rollout layout (one matmul for q/k/v and one for gate/up) loads the same checkpoint,
    computes the same logits, yields the same named tensors and loads new ones into the right rows."""
    _, ours = pair
    fused = models.from_pretrained(ours.source_path, fused_projections=True)
    attention, mlp = fused.layers[0].attention, fused.layers[0].feed_forward
    assert isinstance(attention.wqkv, FusedLinear) and isinstance(mlp.w13, FusedLinear)
    assert not hasattr(attention, "wq") and not hasattr(mlp, "w1")
    seqs, ids, positions, cu = lengths_to_packed(LENGTHS, VOCAB, seed=4)
    with torch.no_grad():
        kw = dict(position_ids=positions, cu_seqlens=cu, max_seqlen=max(LENGTHS))
        assert_close(fused(ids, **kw), ours(ids, **kw))
    want = dict(models.hf_named_tensors(ours))
    got = dict(models.hf_named_tensors(fused))
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)
    update = {n: torch.randn_like(t) for n, t in want.items()}
    assert models.load_hf_tensors(fused, update.items()) == set(native_keys(ours))
    assert all(torch.equal(t, update[n]) for n, t in models.hf_named_tensors(fused))
