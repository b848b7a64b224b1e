"""Token-budget micro-batching and data-parallel load balancing, as pure index arithmetic.

Both functions take per-sample token counts (prompt + response, every token the model computes)
and return lists of sample indices. They are deterministic: every rank computes the same plan from
the same global batch, so no plan has to be communicated.
"""

from __future__ import annotations

from collections.abc import Sequence


def balance_across_ranks(num_tokens: Sequence[int], num_ranks: int) -> list[list[int]]:
    """Spread samples over `num_ranks` ranks balancing tokens, not counts.

    Greedy longest-first: samples in order of decreasing token count (ties by index) each go to the
    rank with the fewest tokens so far (ties to the lowest rank). Each rank's list is sorted by
    sample index. A rank may receive no sample when there are fewer samples than ranks.
    """
    if num_ranks < 1:
        raise ValueError(
            f"num_ranks={num_ranks} is invalid: must be >= 1. Fix: pass the data-parallel world size."
        )
    loads = [0] * num_ranks
    shares: list[list[int]] = [[] for _ in range(num_ranks)]
    for i in sorted(range(len(num_tokens)), key=lambda i: (-num_tokens[i], i)):
        rank = min(range(num_ranks), key=lambda r: (loads[r], r))
        shares[rank].append(i)
        loads[rank] += num_tokens[i]
    return [sorted(share) for share in shares]


def pack_micro_batches(indices: Sequence[int], num_tokens: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Pack the samples `indices` into micro-batches of at most `max_tokens` tokens each.

    First-fit decreasing: samples in order of decreasing token count (ties by index) go to the first
    micro-batch with room. A sample longer than `max_tokens` gets a micro-batch of its own and is
    never truncated. `num_tokens` is indexed by sample index (the global batch). Micro-batches come
    out in creation order (largest first), each sorted by sample index.
    """
    if max_tokens < 1:
        raise ValueError(
            f"max_tokens_per_micro_batch={max_tokens} is invalid: must be >= 1. Fix: set "
            "train.max_tokens_per_micro_batch to a positive token budget, e.g. 4096."
        )
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(indices, key=lambda i: (-num_tokens[i], i)):
        n = num_tokens[i]
        for b, load in enumerate(loads):
            if load + n <= max_tokens:
                bins[b].append(i)
                loads[b] += n
                break
        else:
            bins.append([i])
            loads.append(n)
    return [sorted(b) for b in bins]


def plan_rank(
    num_tokens: Sequence[int], *, rank: int, num_ranks: int, max_tokens: int
) -> tuple[list[list[int] | None], int]:
    """Micro-batches of one data-parallel rank, padded with `None` to the most any rank has.

    Every rank computes every rank's plan (cheap index arithmetic), so all agree on the number of
    micro-batches without communicating; a `None` is a zero-weight filler micro-batch that keeps the
    rank's collectives in step with the others. Returns (plan, filler sample index): the filler is
    the rank's smallest sample (or the batch's, for a rank without samples).
    """
    shares = balance_across_ranks(num_tokens, num_ranks)
    plans = [pack_micro_batches(share, num_tokens, max_tokens) for share in shares]
    num_steps = max(len(p) for p in plans)
    mine: list[list[int] | None] = list(plans[rank])
    filler = min(shares[rank] or range(len(num_tokens)), key=lambda i: (num_tokens[i], i))
    return mine + [None] * (num_steps - len(mine)), filler
