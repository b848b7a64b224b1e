"""Arithmetic task: "What is 12 + 35? Answer with just the number." with the integer as ground truth.

Each problem draws two operands of `num_digits` digits (0-9 for one digit) and one operator from
`operators` (a string of `+`, `-`, `*`). For `-` the larger operand comes first, so answers are
never negative: small chat models learn the task faster, and the reward still reads negative
numbers when a response has them. The wording is short on purpose, for a 135M chat model.
"""

from __future__ import annotations

import random

from rlloom.data.dataset import RawPrompt
from rlloom.tasks.split import Problem, Split, draw_split

_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def arithmetic_question(a: int, op: str, b: int) -> str:
    """The prompt text of one problem."""
    return f"What is {a} {op} {b}? Answer with just the number."


def draw_arithmetic(rng: random.Random, *, num_digits: int, operators: str) -> Problem:
    """One random problem."""
    low = 0 if num_digits == 1 else 10 ** (num_digits - 1)
    high = 10**num_digits - 1
    a, b = rng.randint(low, high), rng.randint(low, high)
    op = rng.choice(operators)
    if op == "-" and b > a:
        a, b = b, a
    answer = _APPLY[op](a, b)
    return Problem(
        key=(a, op, b),
        prompt=arithmetic_question(a, op, b),
        ground_truth=str(answer),
        metadata={"a": a, "op": op, "b": b},
    )


def arithmetic_prompts(
    *, split: Split, num_train: int, num_eval: int, num_digits: int, operators: str, seed: int
) -> list[RawPrompt]:
    """The train or eval prompts (disjoint sets, see `rlloom.tasks.split`)."""
    if not operators or set(operators) - set(_APPLY):
        raise ValueError(f"data.operators={operators!r} must be a non-empty string of + - *; fix: e.g. '+-'")
    return draw_split(
        lambda rng: draw_arithmetic(rng, num_digits=num_digits, operators=operators),
        task="arithmetic",
        split=split,
        num_train=num_train,
        num_eval=num_eval,
        seed=seed,
    )
