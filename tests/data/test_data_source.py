"""PromptSource: seeded epochs, exact resume from state_dict, batches across epoch boundaries."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlloom.data.dataset import PromptItem
from rlloom.data.source import PromptSource, epoch_order


def items(n):
    return [
        PromptItem(prompt_ids=[i + 1], prompt_text=str(i), ground_truth=str(i), index=i) for i in range(n)
    ]


def indices(batch):
    return [p.index for p in batch]


def test_each_epoch_is_a_permutation_reshuffled_by_seed_and_epoch():
    src = PromptSource(items(10), seed=3)
    epoch0, epoch1 = indices(src.next_batch(10)), indices(src.next_batch(10))
    assert sorted(epoch0) == sorted(epoch1) == list(range(10))
    assert epoch0 != epoch1
    assert epoch0 == epoch_order(10, seed=3, epoch=0) and epoch1 == epoch_order(10, seed=3, epoch=1)
    assert epoch_order(10, seed=4, epoch=0) != epoch0
    assert indices(PromptSource(items(5), shuffle=False).next_batch(7)) == [0, 1, 2, 3, 4, 0, 1]


def test_resume_continues_exactly_across_epoch_boundaries():
    straight = PromptSource(items(10), seed=7)
    expected = [indices(straight.next_batch(4)) for _ in range(8)]

    first = PromptSource(items(10), seed=7)
    got = [indices(first.next_batch(4)) for _ in range(3)]  # 12 prompts: into epoch 1
    state = first.state_dict()
    assert state == {"epoch": 1, "cursor": 2, "seed": 7, "num_items": 10, "returned": []}

    resumed = PromptSource(items(10), seed=7)
    resumed.load_state_dict(dict(state))
    got += [indices(resumed.next_batch(4)) for _ in range(5)]
    assert got == expected


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(1, 12),
    sizes=st.lists(st.integers(1, 15), min_size=1, max_size=8),
    cut=st.integers(0, 8),
    seed=st.integers(0, 3),
)
def test_any_split_point_resumes_to_the_same_stream(n, sizes, cut, seed):
    straight = PromptSource(items(n), seed=seed)
    expected = [indices(straight.next_batch(k)) for k in sizes]
    a = PromptSource(items(n), seed=seed)
    got = [indices(a.next_batch(k)) for k in sizes[:cut]]
    b = PromptSource(items(n), seed=seed)
    b.load_state_dict(a.state_dict())
    got += [indices(b.next_batch(k)) for k in sizes[cut:]]
    assert got == expected


def test_prompts_given_back_are_drawn_again_first_and_no_other_prompt_twice():
    # The asynchronous loop's drain: job A drew 0-1, job B 2-3, A's second round 4; A is trained, B
    # is dropped. Rewinding the cursor to B's start would draw 4 again in this epoch.
    src = PromptSource(items(8), seed=1, shuffle=False)
    a = src.next_positions(2)
    b = src.next_positions(2)
    a += src.next_positions(1)
    src.give_back(b)
    state = src.state_dict()
    assert state["returned"] == [[0, 2], [0, 3]] and state["cursor"] == 5
    rest = indices(src.next_batch(2)) + indices(src.next_batch(3))
    assert [src.item_at(p).index for p in a] == [0, 1, 4] and rest == [2, 3, 5, 6, 7]

    resumed = PromptSource(items(8), seed=1, shuffle=False)
    resumed.load_state_dict(state)
    assert indices(resumed.next_batch(5)) == rest
    old = {"epoch": 0, "cursor": 5, "seed": 1, "num_items": 8}  # saved before prompts were given back
    resumed.load_state_dict(old)
    assert indices(resumed.next_batch(2)) == [5, 6]


def test_a_prompt_given_back_across_an_epoch_end_keeps_its_epoch_order():
    src = PromptSource(items(5), seed=2)
    src.next_batch(4)
    dropped = src.next_positions(3)  # the last of epoch 0, the first two of epoch 1
    src.give_back(dropped)
    assert (
        indices(src.next_batch(3))
        == epoch_order(5, seed=2, epoch=0)[4:] + epoch_order(5, seed=2, epoch=1)[:2]
    )
    assert indices(src.next_batch(3)) == epoch_order(5, seed=2, epoch=1)[2:]


def test_state_from_other_data_is_refused():
    src = PromptSource(items(10), seed=0)
    with pytest.raises(ValueError, match="same data settings"):
        src.load_state_dict({"epoch": 0, "cursor": 0, "seed": 0, "num_items": 9})
    with pytest.raises(ValueError, match="same data settings"):
        src.load_state_dict({"epoch": 0, "cursor": 0, "seed": 1, "num_items": 10})
    with pytest.raises(ValueError, match="out of range"):
        src.load_state_dict({"epoch": 0, "cursor": 11, "seed": 0, "num_items": 10})
    with pytest.raises(ValueError, match="out of range"):
        src.load_state_dict({"epoch": 0, "cursor": 1, "seed": 0, "num_items": 10, "returned": [[0, 10]]})


def test_empty_source_and_bad_batch_size():
    with pytest.raises(ValueError, match="no prompts"):
        PromptSource([]).next_batch(1)
    with pytest.raises(ValueError, match="num_prompts"):
        PromptSource(items(2)).next_batch(0)
