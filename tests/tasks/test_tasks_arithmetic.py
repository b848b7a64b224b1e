"""Arithmetic task: deterministic, correct ground truths, disjoint train and eval."""

import pytest

from rlloom.rewards.numbers import number_match
from rlloom.tasks.arithmetic import arithmetic_prompts


def make(split, **kw):
    args = dict(num_train=300, num_eval=50, num_digits=2, operators="+-*", seed=0) | kw
    return arithmetic_prompts(split=split, **args)


def test_same_seed_same_prompts_other_seed_other_prompts():
    assert make("train") == make("train")
    assert [p.prompt for p in make("train")] != [p.prompt for p in make("train", seed=1)]


def test_ground_truth_is_the_value_and_the_wording_is_short():
    for p in make("train"):
        a, op, b = p.metadata["a"], p.metadata["op"], p.metadata["b"]
        assert p.prompt == f"What is {a} {op} {b}? Answer with just the number."
        assert p.ground_truth == str({"+": a + b, "-": a - b, "*": a * b}[op])
        assert 10 <= a <= 99 and 10 <= b <= 99 and int(p.ground_truth) >= 0
        assert number_match(f"{a} {op} {b} = {p.ground_truth}", p.ground_truth) == 1.0
    assert {p.metadata["op"] for p in make("train")} == {"+", "-", "*"}


def test_train_and_eval_are_disjoint_and_eval_is_unique_and_fixed():
    train, evals = make("train"), make("eval")
    assert len(train) == 300 and len(evals) == 50
    assert not {p.prompt for p in train} & {p.prompt for p in evals}
    assert len({p.prompt for p in evals}) == 50
    assert make("eval", num_train=7) == evals  # eval does not depend on num_train


def test_small_problem_space():
    one_digit = make("train", num_digits=1, operators="+", num_eval=20, num_train=500)
    assert len(one_digit) == 500  # duplicates allowed in train
    with pytest.raises(ValueError, match="data.num_eval"):
        make("eval", num_digits=1, operators="+", num_eval=101)
    with pytest.raises(ValueError, match="data.num_eval"):
        make("train", num_digits=1, operators="+", num_eval=100)
