"""Packed streams and the attention-backend hook against per-sequence references.

- packed forward == each sequence run alone (dense GQA and MLA models);
- the packed kernel == naive attention with a block-diagonal causal mask;
- the `attn` backend hook, driven by a reference backend that keeps its own contiguous k/v cache
  per sequence and decodes in several steps (prefill, one token, the rest), == the packed forward.
"""

from __future__ import annotations

import math

import pytest
import torch
from models_testutil import assert_close, lengths_to_packed, randomize_
from transformers import DeepseekV3Config, Qwen3Config

from rlloom.models import CausalLM, ModelArgs, attention_ops

VOCAB = 96
LENGTHS = [9, 3, 17, 6]


def _dense() -> CausalLM:
    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    return CausalLM(ModelArgs.from_hf_config(cfg.to_dict()))


def _mla() -> CausalLM:
    cfg = DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=4,
        n_routed_experts=8,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
    )
    return CausalLM(ModelArgs.from_hf_config(cfg.to_dict()))


@pytest.fixture(scope="module", params=["dense", "mla"])
def model(request):
    torch.manual_seed(0)
    return randomize_(_dense() if request.param == "dense" else _mla(), seed=4).eval()


@torch.no_grad()
def test_packed_equals_per_sequence(model):
    seqs, ids, positions, cu = lengths_to_packed(LENGTHS, VOCAB, seed=5)
    packed = model(ids, position_ids=positions, cu_seqlens=cu)
    alone = torch.cat([model(s[None])[0] for s in seqs])
    assert_close(packed, alone)


@torch.no_grad()
def test_packed_kernel_equals_block_diagonal_masked_attention():
    torch.manual_seed(1)
    cu = torch.tensor([0, 5, 6, 20, 31], dtype=torch.int32)
    q, k, v = torch.randn(31, 8, 16), torch.randn(31, 2, 16), torch.randn(31, 2, 12)
    seq_id = torch.repeat_interleave(torch.arange(4), (cu[1:] - cu[:-1]).long())
    visible = (seq_id[:, None] == seq_id[None, :]) & torch.ones(31, 31, dtype=torch.bool).tril()
    scores = torch.einsum("nhd,mhd->hnm", q, k.repeat_interleave(4, dim=1)) * 0.3
    probs = scores.masked_fill(~visible, -math.inf).softmax(-1)
    expected = torch.einsum("hnm,mhd->nhd", probs, v.repeat_interleave(4, dim=1))
    assert_close(attention_ops.packed_attention(q, k, v, 0.3, cu), expected, atol=1e-5)


class CachingBackend:
    """Reference backend: per (layer, sequence) contiguous k/v; naive softmax attention. Called once
    per layer in order, it counts the layers of a forward (set `new_lens` before each)."""

    def __init__(self) -> None:
        self.cache: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._new_lens: list[int] = []
        self.layer = 0

    @property
    def new_lens(self) -> list[int]:
        return self._new_lens

    @new_lens.setter
    def new_lens(self, lens: list[int]) -> None:
        self._new_lens, self.layer = lens, 0

    def attn(self, q, k, v, scale):
        layer_idx, self.layer = self.layer, self.layer + 1
        outs, start = [], 0
        for seq, n in enumerate(self.new_lens):
            k_old, v_old = self.cache.get((layer_idx, seq), (k[:0], v[:0]))
            k_all, v_all = torch.cat([k_old, k[start : start + n]]), torch.cat([v_old, v[start : start + n]])
            self.cache[(layer_idx, seq)] = (k_all, v_all)
            outs.append(_naive_attention(q[start : start + n], k_all, v_all, scale))
            start += n
        return torch.cat(outs)


def _naive_attention(q, k, v, scale):
    """q [n, Hq, D] are the last n positions of a sequence whose keys are k/v [m, Hkv, D]."""
    n, m, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,mhd->hnm", q, k) * scale
    visible = torch.arange(m)[None, :] <= torch.arange(m - n, m)[:, None]
    scores = scores.masked_fill(~visible, -math.inf)
    return torch.einsum("hnm,mhd->nhd", scores.softmax(-1), v)


def _cuts(n: int) -> list[tuple[int, int]]:
    half, one_more = max(1, n // 2), min(max(1, n // 2) + 1, n)
    return [(0, half), (half, one_more), (one_more, n)]


@torch.no_grad()
def test_backend_hook_decoding_equals_packed(model):
    seqs, ids, positions, cu = lengths_to_packed(LENGTHS, VOCAB, seed=6)
    expected = model(ids, position_ids=positions, cu_seqlens=cu)
    backend = CachingBackend()
    # Three steps per sequence: a prefix, one decode token, the rest (empty for short sequences).
    pieces: list[list[torch.Tensor]] = [[] for _ in seqs]
    for step in range(3):
        lo_hi = [_cuts(len(s))[step] for s in seqs]
        backend.new_lens = [hi - lo for lo, hi in lo_hi]
        step_ids = torch.cat([s[lo:hi] for s, (lo, hi) in zip(seqs, lo_hi)])
        step_pos = torch.cat([torch.arange(lo, hi) for lo, hi in lo_hi])
        logits = model(step_ids, position_ids=step_pos, attn=backend)
        for i, part in enumerate(logits.split(backend.new_lens)):
            pieces[i].append(part)
    actual = torch.cat([torch.cat(p) for p in pieces])
    assert_close(actual, expected)


def test_backend_requires_flat_input_with_positions(model):
    with pytest.raises(ValueError, match="position_ids"):
        model(torch.zeros(2, 3, dtype=torch.long), attn=CachingBackend())
