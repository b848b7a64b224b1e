"""Block manager reference counts and copy-on-write, scheduler preemption, sampler exactness."""

from __future__ import annotations

import numpy as np
import torch

from rlloom.engines.rollout.base import SamplingParams
from rlloom.engines.rollout.native.block_manager import BlockManager
from rlloom.engines.rollout.native.paged_decode import shared_prefix_groups
from rlloom.engines.rollout.native.sampler import Sampler, SamplingRows, noise_key
from rlloom.engines.rollout.native.scheduler import Scheduler
from rlloom.engines.rollout.native.sequence import Sequence, pending


def _seq(i: int, prompt_len: int, **params) -> Sequence:
    return Sequence(
        seq_id=i, request_id=str(i), prompt_index=i, sample_index=0, prompt_ids=list(range(1, prompt_len + 1)),
        params=SamplingParams(**params), policy_version=0,
    )  # fmt: skip


def test_fork_shares_blocks_and_copies_the_partial_block_on_write():
    bm = BlockManager(num_blocks=10, block_size=4)
    leader, child = _seq(0, 6), _seq(1, 6)
    bm.allocate(leader)
    assert len(leader.block_table) == 2 and bm.num_used_blocks == 2
    leader.num_cached_tokens = 6
    bm.fork(leader, child)
    assert child.block_table == leader.block_table
    assert [bm.ref_counts[b] for b in leader.block_table] == [2, 2]
    # Both sample a token; position 6 lies in the shared partial block 1: the first writer copies it.
    leader.output_ids.append(7)
    child.output_ids.append(8)
    assert bm.append_cost(leader) == 1
    bm.may_append(leader)
    assert bm.take_pending_copies() == [(child.block_table[1], leader.block_table[1])]
    assert leader.block_table[0] == child.block_table[0] and leader.block_table[1] != child.block_table[1]
    assert bm.append_cost(child) == 0  # now its only holder: writes in place
    bm.may_append(child)
    assert bm.take_pending_copies() == []
    assert bm.ref_counts[leader.block_table[0]] == 2 and bm.num_used_blocks == 3
    bm.free(leader)
    bm.free(child)
    assert bm.num_free_blocks == 10 and not any(bm.ref_counts)


def test_new_block_at_a_block_boundary():
    bm = BlockManager(num_blocks=3, block_size=4)
    seq = _seq(0, 4)
    bm.allocate(seq)
    seq.output_ids.append(5)
    assert bm.append_cost(seq) == 1
    bm.may_append(seq)
    assert len(seq.block_table) == 2 and bm.take_pending_copies() == []


def test_scheduler_preempts_the_newest_sequence_when_blocks_run_out():
    bm = BlockManager(num_blocks=4, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, eos_token_ids=[])
    a, b = _seq(0, 8, max_new_tokens=20), _seq(1, 8, max_new_tokens=20)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert batch.is_prefill and batch.seqs == [a, b] and bm.num_free_blocks == 0
    sched.resolve(batch.rows, sched.launched(batch), [1, 1], [0.0, 0.0])
    batch = sched.schedule()  # both need a new block for position 8; only preempting b frees one
    assert not batch.is_prefill and batch.seqs == [a]
    assert list(sched.waiting) == [b] and b.block_table == [] and sched.num_preemptions == 1


def _overlapped_scheduler(num_blocks: int = 16) -> tuple[BlockManager, Scheduler]:
    bm = BlockManager(num_blocks=num_blocks, block_size=4)
    return bm, Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, eos_token_ids=[2])


def test_a_sequence_that_stops_while_its_next_step_runs_drops_that_step():
    bm, sched = _overlapped_scheduler()
    a, b = _seq(0, 3, max_new_tokens=10), _seq(1, 3, max_new_tokens=10)
    sched.add(a)
    sched.add(b)
    first = sched.schedule()
    first_at = sched.launched(first)
    assert a.output_ids == [pending(0)] and b.output_ids == [pending(1)]
    second = sched.schedule()  # scheduled before the first step's tokens are known
    assert second.seqs == [a, b] and a.num_tokens == 4
    second_at = sched.launched(second)
    assert a.output_ids == [pending(0), pending(0)] and second_at == [1, 1]
    assert sched.resolve(first.rows, first_at, [2, 7], [-0.5, -0.25]) == [a]  # a samples EOS
    assert a.output_ids == [2] and a.logprobs == [-0.5] and a.finish_reason == "stop"
    assert a.block_table == [] and list(sched.running) == [b]
    assert b.output_ids == [7, pending(1)]
    assert sched.resolve(second.rows, second_at, [9, 8], [-1.0, -1.0]) == []  # a's result: ignored
    assert a.output_ids == [2] and b.output_ids == [7, 8] and b.logprobs == [-0.25, -1.0]


def test_a_sequence_whose_pending_token_is_its_last_is_not_scheduled_again():
    bm, sched = _overlapped_scheduler()
    a, b = _seq(0, 3, max_new_tokens=1), _seq(1, 3, max_new_tokens=5)
    sched.add(a)
    sched.add(b)
    first = sched.schedule()
    first_at = sched.launched(first)
    second = sched.schedule()
    assert second.seqs == [b] and set(sched.running) == {a, b}
    sched.launched(second)
    assert sched.resolve(first.rows, first_at, [5, 6], [0.0, 0.0]) == [a]
    assert a.finish_reason == "length" and a.output_ids == [5] and list(sched.running) == [b]


def test_a_sequence_preempted_while_its_step_runs_can_still_finish():
    bm, sched = _overlapped_scheduler(num_blocks=2)
    a, b = _seq(0, 4, max_new_tokens=10), _seq(1, 4, max_new_tokens=10)
    sched.add(a)
    sched.add(b)
    first = sched.schedule()
    first_at = sched.launched(first)
    second = sched.schedule()  # position 4 needs a new block for each: b is preempted
    assert second.seqs == [a] and list(sched.waiting) == [b] and b.output_ids == [pending(1)]
    sched.launched(second)
    assert sched.resolve(first.rows, first_at, [3, 2], [0.0, 0.0]) == [b]  # b samples EOS
    assert not sched.waiting and b.finish_reason == "stop" and b.output_ids == [2]


def test_sampler_frequencies_match_the_truncated_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    rows = 20000
    sampler = Sampler(torch.device("cpu"), seed=0)
    spec = SamplingRows.build([0.7] * rows, [1.0] * rows, [3] * rows, [None] * rows, torch.device("cpu"))
    tokens, logprobs = sampler(logits.expand(rows, -1), spec)
    probs = torch.softmax(logits / 0.7, dim=-1)
    top3 = probs[:3] / probs[:3].sum()
    freq = torch.bincount(tokens, minlength=5).float() / rows
    assert freq[3:].sum() == 0
    assert (freq[:3] - top3).abs().max() < 0.015
    # Reported logprobs are pre-truncation: log_softmax(logits / T), not the renormalised top-3.
    assert torch.allclose(logprobs, torch.log(probs)[tokens], atol=1e-6)


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    rows = 4000
    sampler = Sampler(torch.device("cpu"), seed=1)
    spec = SamplingRows.build([1.0] * rows, [0.75] * rows, [-1] * rows, [None] * rows, torch.device("cpu"))
    tokens, _ = sampler(logits.expand(rows, -1), spec)
    assert set(tokens.tolist()) == {0, 1}


def test_greedy_and_seeded_rows():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    sampler = Sampler(torch.device("cpu"), seed=2)
    keys = [None, noise_key(7, 0, 3), noise_key(7, 0, 3)]
    spec = SamplingRows.build([0.0, 1.0, 1.0], [1.0] * 3, [-1] * 3, keys, torch.device("cpu"))
    tokens, logprobs = sampler(logits[[0, 1, 1]], spec)
    assert tokens[0] == logits[0].argmax()
    assert torch.allclose(logprobs[0], torch.log_softmax(logits[0], -1).max())
    assert tokens[1] == tokens[2]  # same key, same logits -> same token, whatever the batch
    again, _ = Sampler(torch.device("cpu"), seed=99)(
        logits[[1]], SamplingRows.build([1.0], [1.0], [-1], keys[1:2], torch.device("cpu"))
    )
    assert again[0] == tokens[1]


def _naive_groups(tables, positions, block_size, max_members):
    """Runs of at most max_members sequences with the same first block (batch order), each with the
    blocks all members share with the group's first sequence, before the block each one writes."""
    by_first: dict[int, list[int]] = {}
    for row, first in enumerate(tables[:, 0].tolist()):
        by_first.setdefault(first, []).append(row)
    found = []
    for rows in by_first.values():
        leader = tables[rows[0]].tolist()
        for lo in range(0, len(rows), max_members):
            run = rows[lo : lo + max_members]
            common = []
            for r in run:
                same = next((j for j, b in enumerate(tables[r].tolist()) if b != leader[j]), len(leader))
                common.append(min(same, positions[r] // block_size))
            if len(run) > 1 and min(common) > 0:
                found.append((tuple(run), min(common) * block_size))
    return sorted(found)


def test_shared_prefix_groups_match_a_naive_grouping():
    rng = np.random.default_rng(0)
    cut = 0  # cases with a group cut into runs of max_members
    for _ in range(300):
        S, width, max_members = int(rng.integers(1, 30)), int(rng.integers(1, 8)), int(rng.integers(1, 6))
        tables = rng.integers(0, 5, size=(S, width))  # few distinct blocks: many shared prefixes
        positions = rng.integers(0, width * 4, size=S)
        members, num_keys, start = shared_prefix_groups(tables, positions, 4, max_members)
        got = sorted(
            (tuple(int(m) for m in members[g] if m >= 0), int(num_keys[g])) for g in range(S) if num_keys[g]
        )
        want = _naive_groups(tables, positions, 4, max_members)
        assert got == want
        expected_start = np.zeros(S, dtype=np.int64)
        for run, keys in want:
            expected_start[list(run)] = keys
        assert (start == expected_start).all()
        cut += max_members > 1 and sum(len(run) == max_members for run, _ in want) > 1
    assert cut > 20
