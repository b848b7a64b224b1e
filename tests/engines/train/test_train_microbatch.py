"""Token-budget packing and data-parallel balancing, against brute-force properties."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlloom.engines.train.native.microbatch import balance_across_ranks, pack_micro_batches

token_lists = st.lists(st.integers(1, 100), min_size=1, max_size=40)


@settings(max_examples=150, deadline=None)
@given(token_lists, st.integers(1, 150))
def test_packing_covers_each_sample_once_within_budget(num_tokens, budget):
    bins = pack_micro_batches(range(len(num_tokens)), num_tokens, budget)
    assert sorted(i for b in bins for i in b) == list(range(len(num_tokens)))
    for b in bins:
        load = sum(num_tokens[i] for i in b)
        assert load <= budget or len(b) == 1  # an over-long sample is alone, never truncated
        assert b == sorted(b)
    # first-fit decreasing never leaves two micro-batches that would fit together as one
    loads = sorted(sum(num_tokens[i] for i in b) for b in bins)
    assert len(loads) < 2 or loads[0] + loads[1] > budget
    assert pack_micro_batches(range(len(num_tokens)), num_tokens, budget) == bins


def test_packing_examples():
    assert pack_micro_batches([0, 1, 2, 3], [5, 12, 3, 4], 10) == [[1], [0, 3], [2]]
    assert pack_micro_batches([0, 1, 2], [5, 5, 5], 1) == [[0], [1], [2]]
    assert pack_micro_batches([2, 0], [1, 100, 1], 2) == [[0, 2]]
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch=0"):
        pack_micro_batches([0], [3], 0)


@settings(max_examples=150, deadline=None)
@given(token_lists, st.integers(1, 8))
def test_balancing_is_a_partition_close_to_even(num_tokens, num_ranks):
    shares = balance_across_ranks(num_tokens, num_ranks)
    assert len(shares) == num_ranks
    assert sorted(i for s in shares for i in s) == list(range(len(num_tokens)))
    loads = [sum(num_tokens[i] for i in s) for s in shares]
    # greedy longest-first: the spread is at most the largest single sample
    assert max(loads) - min(loads) <= max(num_tokens)
    assert balance_across_ranks(num_tokens, num_ranks) == shares


def test_balancing_by_tokens_not_counts():
    assert balance_across_ranks([100, 10, 10, 10, 10], 2) == [[0], [1, 2, 3, 4]]
    assert balance_across_ranks([3], 2) == [[0], []]
