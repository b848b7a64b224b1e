"""Prefix caching across requests (multi-turn episodes): the block manager's bookkeeping, and an engine
whose next turn reuses the previous turn's blocks samples exactly what one that recomputes them does."""

from __future__ import annotations

import torch

from rlloom.engines.rollout.base import SamplingParams
from rlloom.engines.rollout.native.block_manager import BlockManager
from rlloom.engines.rollout.native.engine import NativeEngine
from rlloom.engines.rollout.native.sequence import Sequence
from rlloom.models.adapter import hf_named_tensors


def _seq(i: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id=i, request_id=str(i), prompt_index=i, sample_index=0, prompt_ids=list(tokens),
                    params=SamplingParams(), policy_version=0)  # fmt: skip


def test_freed_full_blocks_are_found_again_and_evicted_when_reused():
    bm = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    first = _seq(0, list(range(1, 11)))  # 10 tokens: two full blocks and a partial one
    bm.allocate(first)
    first.num_cached_tokens = 10
    table = list(first.block_table)
    bm.free(first)
    assert bm.num_free_blocks == 6 and len(bm.cached) == 2  # only the full blocks are remembered

    again = _seq(1, list(range(1, 11)) + [50, 51])
    bm.allocate(again)
    assert again.block_table[:2] == table[:2] and again.num_cached_tokens == 8 and bm.num_free_blocks == 3
    other = _seq(2, [9] * 12)  # different tokens: no hit
    bm.allocate(other)
    assert other.num_cached_tokens == 0 and bm.num_free_blocks == 0
    bm.free(again)
    bm.free(other)
    assert bm.num_free_blocks == 6 and len(bm.cached) == 2
    exact = _seq(3, list(range(1, 9)))  # exactly two blocks: the last token must be computed, so one hit
    bm.allocate(exact)
    assert exact.num_cached_tokens == 4 and exact.block_table[0] == table[0]
    bm.free(exact)
    everything = _seq(4, [8] * 24)  # takes every block: the remembered ones are evicted
    bm.allocate(everything)
    assert bm.num_free_blocks == 0 and sorted(everything.block_table) == list(range(6)) and not bm.cached
    bm.free(everything)
    bm.clear_prefix_cache()
    assert not bm.cached and not bm.block_hash


def _engine(ckpt, caching: bool) -> NativeEngine:
    return NativeEngine.from_pretrained(
        ckpt, num_blocks=64, block_size=4, max_model_len=256, seed=0, enable_prefix_caching=caching
    )


def test_a_turn_that_reuses_cached_blocks_samples_what_a_recomputed_one_does(tiny_checkpoint):
    cached, plain = _engine(tiny_checkpoint, True), _engine(tiny_checkpoint, False)
    prompt = [3 + (7 * i) % 90 for i in range(37)]
    first = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=5)
    a, b = cached.generate([prompt], [first]), plain.generate([prompt], [first])
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    turns = [prompt + c.token_ids + [40, 41, 42] for c in a]
    later = [SamplingParams(temperature=1.0, max_new_tokens=10, seed=9 + j) for j in range(2)]
    hits = cached.block_manager.num_cached_hits
    a2, b2 = cached.generate(turns, later), plain.generate(turns, later)
    saved = cached.block_manager.num_cached_hits - hits
    assert saved >= 2 * 4 * ((len(prompt) + 12 - 1) // 4 - 1), saved  # both turns found their history
    assert plain.block_manager.num_cached_hits == 0
    assert [c.token_ids for c in a2] == [c.token_ids for c in b2]
    torch.testing.assert_close(
        torch.tensor([c.logprobs for c in a2]), torch.tensor([c.logprobs for c in b2]), atol=1e-5, rtol=0
    )
    cached.update_weights(hf_named_tensors(cached.model), version=1)  # new weights: nothing stale is reused
    assert not cached.block_manager.cached


def test_a_prefill_served_by_the_cache_is_budgeted_by_its_new_tokens():
    """Next turns of 40 tokens, 36 of them cached: 4 new each. A budget of 64 padded new tokens would
    admit 16 of them in one prefill (a budget counting every token admits 1); the key budget of
    8 x 64 gathered keys stops it at 12."""
    from rlloom.engines.rollout.native.scheduler import Scheduler

    bm = BlockManager(num_blocks=512, block_size=4, enable_prefix_caching=True)  # no eviction
    history = [_seq(i, [i + 1] * 36) for i in range(14)]
    for seq in history:  # each turn's 36 tokens computed, then freed: 9 full blocks remembered
        bm.allocate(seq)
        seq.num_cached_tokens = 36
        bm.free(seq)
    sched = Scheduler(bm, max_num_seqs=32, max_num_batched_tokens=64, max_model_len=128, eos_token_ids=[])
    for i in range(14):
        sched.add(_seq(10 + i, [i + 1] * 36 + [90] * 4))
    batch = sched.schedule()
    assert batch is not None and batch.is_prefill
    assert [s.num_tokens - s.num_cached_tokens for s in batch.seqs] == [4] * 12  # 13 x 40 keys > 512
    assert len(sched.waiting) == 2
