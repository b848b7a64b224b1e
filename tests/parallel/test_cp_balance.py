"""Context parallelism's load balancing (`balance_chunks`, pure) and the layout CP refuses."""

from __future__ import annotations

import random

import pytest

from rlloom.parallel.cp import balance_chunks, check_cp_layout


def _cost(start: int, end: int) -> int:
    """Query-key pairs of causal attention for document positions [start, end)."""
    return sum(p + 1 for p in range(start, end))


def _lengths(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [
        rng.choice([1, 1, 2, 3, rng.randint(4, 40), rng.randint(40, 300)]) for _ in range(rng.randint(1, 12))
    ]


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("seed", range(6))
def test_every_token_goes_to_exactly_one_rank(cp, seed):
    lengths = _lengths(seed)
    shares = balance_chunks(lengths, cp)
    assert len(shares) == cp
    seen = [(c.doc, p) for share in shares for c in share for p in range(c.start, c.end)]
    assert sorted(seen) == [(s, p) for s, length in enumerate(lengths) for p in range(length)]
    for share in shares:
        assert all(c.end > c.start for c in share)
        assert [c.doc for c in share] == sorted(c.doc for c in share)  # documents in stream order


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("seed", range(6))
def test_tokens_and_causal_cost_are_balanced_within_the_stated_bound(cp, seed):
    lengths = _lengths(seed)
    shares = balance_chunks(lengths, cp)
    for s, length in enumerate(lengths):  # per document: tokens within 2, cost within 2 (L + 1)
        tokens = [sum(c.end - c.start for c in share if c.doc == s) for share in shares]
        costs = [sum(_cost(c.start, c.end) for c in share if c.doc == s) for share in shares]
        assert max(tokens) - min(tokens) <= 2, (length, tokens)
        assert max(costs) - min(costs) < 2 * (length + 1), (length, costs)


def test_a_long_document_is_balanced_where_a_contiguous_split_is_not():
    length, cp = 1000, 2
    (share0, share1) = balance_chunks([length], cp)
    costs = [sum(_cost(c.start, c.end) for c in share) for share in (share0, share1)]
    assert max(costs) / min(costs) < 1.005
    contiguous = [_cost(0, length // 2), _cost(length // 2, length)]
    assert contiguous[1] / contiguous[0] > 2.9  # what the pairing fixes
    assert [(c.start, c.end) for c in share0] == [(0, 250), (750, 1000)]  # rank 0: chunks 0 and 3
    assert [(c.start, c.end) for c in share1] == [(250, 750)]  # chunks 1 and 2, which touch


def test_single_token_documents_rotate_over_the_ranks():
    shares = balance_chunks([1] * 8, 2)
    assert [len(share) for share in shares] == [4, 4]


def test_one_rank_keeps_whole_documents():
    assert [[(c.doc, c.start, c.end) for c in share] for share in balance_chunks([3, 5], 1)] == [
        [(0, 0, 3), (1, 0, 5)]
    ]


def test_invalid_degree_is_refused():
    with pytest.raises(ValueError, match=r"parallel.cp=0 is invalid"):
        balance_chunks([4], 0)


def test_shared_prompt_packing_is_refused_with_the_fix():
    with pytest.raises(
        ValueError, match=r"train.share_prompts=true .* parallel.cp=2.*Fix: set train.share_prompts=false"
    ):
        check_cp_layout(2, True)
    check_cp_layout(2, False)
    check_cp_layout(1, True)
