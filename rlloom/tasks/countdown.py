"""Countdown task: reach a target with 3 or 4 given numbers and + - * / (each number EXACTLY once).

Every instance is solvable by construction: the numbers are drawn first, combined by a random
expression tree (subtraction only when it stays non-negative, division only when exact), and the
value of that expression becomes the target. Targets outside [1, 100] are redrawn. The
ground truth is JSON `{"numbers": [...], "target": n}`; the constructing expression is kept in
`metadata["solution"]` (one solution; others may exist). The reward is
`rlloom.rewards.countdown.countdown_reward`.
"""

from __future__ import annotations

import json
import random

from rlloom.data.dataset import RawPrompt
from rlloom.tasks.split import Problem, Split, draw_split

MIN_NUMBER, MAX_NUMBER = 1, 25
MIN_TARGET, MAX_TARGET = 1, 100
COUNTS = (3, 4)
"""How many numbers a problem has."""


def countdown_question(numbers: list[int], target: int) -> str:
    """The prompt text of one problem."""
    listed = ", ".join(str(n) for n in numbers[:-1]) + f" and {numbers[-1]}"
    return (
        f"Use the numbers {listed} to make {target}. Use each number exactly once, with + - * / and "
        "parentheses. End with 'Answer: <expression>'."
    )


def combine(rng: random.Random, terms: list[tuple[int, str]]) -> tuple[int, str]:
    """Reduce (value, expression) terms to one by random operations with non-negative integer values."""
    terms = list(terms)
    while len(terms) > 1:
        (a, ea), (b, eb) = terms.pop(rng.randrange(len(terms))), terms.pop(rng.randrange(len(terms)))
        if a < b:
            (a, ea), (b, eb) = (b, eb), (a, ea)
        ops = ["+", "-", "*"] + (["/"] if b != 0 and a % b == 0 else [])
        op = rng.choice(ops)
        value = {"+": a + b, "-": a - b, "*": a * b, "/": a // b if b else 0}[op]
        terms.append((value, f"({ea} {op} {eb})"))
    value, expr = terms[0]
    return value, expr[1:-1] if expr.startswith("(") and expr.endswith(")") else expr


def draw_countdown(rng: random.Random) -> Problem:
    """One random solvable problem."""
    while True:
        numbers = [rng.randint(MIN_NUMBER, MAX_NUMBER) for _ in range(rng.choice(COUNTS))]
        target, solution = combine(rng, [(n, str(n)) for n in numbers])
        if MIN_TARGET <= target <= MAX_TARGET:
            break
    return Problem(
        key=(tuple(sorted(numbers)), target),
        prompt=countdown_question(numbers, target),
        ground_truth=json.dumps({"numbers": numbers, "target": target}),
        metadata={"numbers": numbers, "target": target, "solution": solution},
    )


def countdown_prompts(*, split: Split, num_train: int, num_eval: int, seed: int) -> list[RawPrompt]:
    """The train or eval prompts (disjoint sets, see `rlloom.tasks.split`)."""
    return draw_split(
        draw_countdown, task="countdown", split=split, num_train=num_train, num_eval=num_eval, seed=seed
    )
