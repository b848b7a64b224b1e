"""Token-budget micro-batching and data-parallel load balancing, as pure index arithmetic.

The planners take per-item token counts (every token the model computes) and return lists of item
indices. An item is a sample (prompt + response), or with shared-prompt packing a unit from
`shared_prompt_units`: a group's prompt plus the responses packed behind it. Everything is
deterministic: every rank computes the same plan from the same global batch, so no plan has to be
communicated.
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


def shared_prompt_units(
    groups: Sequence[Sequence[int]], prompt_lens: Sequence[int], response_lens: Sequence[int], max_tokens: int
) -> tuple[list[list[int]], list[int]]:
    """Packing units for shared-prompt packing: (units as sample index lists, tokens of each unit).

    `groups` are the sample indices sharing one prompt (`RolloutBatch.shared_prompt_groups()`);
    `prompt_lens` and `response_lens` are indexed by sample. A group costs its prompt once plus all
    its responses. A group over `max_tokens` is split into sub-groups, each with its own prompt copy:
    responses first-fit decreasing into sub-groups of at most `max_tokens` tokens; a sample that alone
    exceeds the budget is a unit of its own (never truncated). First fit keeps any two sub-groups of
    a group from fitting one micro-batch together, so they never share a segment again.
    """
    units: list[list[int]] = []
    unit_tokens: list[int] = []
    for group in groups:
        prompt_len = prompt_lens[group[0]]
        total = prompt_len + sum(response_lens[i] for i in group)
        if total <= max_tokens:
            units.append(sorted(group))
            unit_tokens.append(total)
            continue
        sub_units, sub_loads = [], []
        for i in sorted(group, key=lambda i: (-response_lens[i], i)):
            for u, load in enumerate(sub_loads):
                if load + response_lens[i] <= max_tokens:
                    sub_units[u].append(i)
                    sub_loads[u] += response_lens[i]
                    break
            else:
                sub_units.append([i])
                sub_loads.append(prompt_len + response_lens[i])
        units.extend(sorted(u) for u in sub_units)
        unit_tokens.extend(sub_loads)
    return units, unit_tokens


def plan_rank(
    num_tokens: Sequence[int],
    *,
    rank: int,
    num_ranks: int,
    max_tokens: int,
    units: Sequence[Sequence[int]] | None = None,
) -> tuple[list[list[int] | None], int]:
    """Micro-batches (sample indices) of one data-parallel rank, padded with `None` to the most any rank has.

    `num_tokens` is per sample, or per unit when `units` (lists of sample indices, e.g. from
    `shared_prompt_units`) is given: units are then balanced and packed whole.
    Every rank computes every rank's plan (cheap index arithmetic), so all agree on the number of
    micro-batches without communicating; a `None` is a zero-weight filler micro-batch that keeps the
    rank's collectives in step with the others. Returns (plan, filler sample index): the filler is
    the first sample of the rank's smallest item (or the batch's, for a rank without items).
    """
    members = [list(u) for u in units] if units is not None else [[i] for i in range(len(num_tokens))]
    shares = balance_across_ranks(num_tokens, num_ranks)
    plans = [pack_micro_batches(share, num_tokens, max_tokens) for share in shares]
    num_steps = max(len(p) for p in plans)
    mine: list[list[int] | None] = [sorted(i for u in mb for i in members[u]) for mb in plans[rank]]
    smallest = min(shares[rank] or range(len(num_tokens)), key=lambda u: (num_tokens[u], u))
    return mine + [None] * (num_steps - len(mine)), min(members[smallest])
