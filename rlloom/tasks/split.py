"""Disjoint train and eval sets for procedural tasks, drawn deterministically from a seed.

The eval set is drawn first, from its own random stream (`<task>:eval:<seed>`), with no repeated
problem; it therefore stays the same whatever `num_train` is, so evaluations of different runs
compare. The train set is drawn from another stream (`<task>:train:<seed>`) and rejects every
problem of the eval set; it may repeat problems (a small problem space is still trainable).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Literal

from rlloom.data.dataset import RawPrompt

Split = Literal["train", "eval"]


@dataclass(kw_only=True, slots=True)
class Problem:
    """One generated problem: a key identifying it (for de-duplication) and its prompt data."""

    key: Hashable
    prompt: str
    ground_truth: str
    metadata: dict[str, Any] = field(default_factory=dict)


Draw = Callable[[random.Random], Problem]
"""Draws one random problem from a random stream."""

_TRIES_PER_ITEM = 50  # draws allowed per wanted item before the problem space counts as exhausted


def draw_split(
    draw: Draw, *, task: str, split: Split, num_train: int, num_eval: int, seed: int
) -> list[RawPrompt]:
    """`num_train` train or `num_eval` eval prompts of a task; the two sets share no problem.

    Raises ValueError when the problem space is too small for `num_eval` distinct eval problems
    with problems left over for training.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split={split!r} must be 'train' or 'eval'")
    eval_problems = _draw_unique(draw, random.Random(f"{task}:eval:{seed}"), num_eval, task=task)
    if split == "eval":
        problems = eval_problems
    else:
        held_out = {p.key for p in eval_problems}
        problems = _draw_excluding(
            draw, random.Random(f"{task}:train:{seed}"), num_train, held_out, task=task
        )
    return [
        RawPrompt(
            prompt=p.prompt, ground_truth=p.ground_truth, index=i, metadata={"task": task, **p.metadata}
        )
        for i, p in enumerate(problems)
    ]


def _max_tries(count: int) -> int:
    return _TRIES_PER_ITEM * count + 100


def _draw_unique(draw: Draw, rng: random.Random, count: int, *, task: str) -> list[Problem]:
    seen: set[Hashable] = set()
    problems: list[Problem] = []
    for _ in range(_max_tries(count)):
        if len(problems) == count:
            break
        problem = draw(rng)
        if problem.key not in seen:
            seen.add(problem.key)
            problems.append(problem)
    if len(problems) == count:
        return problems
    raise ValueError(
        f"data.num_eval={count}: the {task} task found only {len(problems)} distinct problems with these "
        "settings; fix: lower data.num_eval or widen the problem space (e.g. more data.num_digits or data.operators)"
    )


def _draw_excluding(
    draw: Draw, rng: random.Random, count: int, excluded: set[Hashable], *, task: str
) -> list[Problem]:
    problems: list[Problem] = []
    for _ in range(_max_tries(count)):
        if len(problems) == count:
            break
        problem = draw(rng)
        if problem.key not in excluded:
            problems.append(problem)
    if len(problems) == count:
        return problems
    raise ValueError(
        f"data.num_eval={len(excluded)}: the held-out {task} problems leave almost none for training; "
        "fix: lower data.num_eval or widen the problem space (e.g. more data.num_digits or data.operators)"
    )
