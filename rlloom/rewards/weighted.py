"""The reward function type, and weighted sums of reward functions (e.g. correctness + format bonus)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

RewardFn = Callable[[str, str], float]
"""A reward function: (response_text, ground_truth) -> score."""


@dataclass(frozen=True, slots=True)
class WeightedReward:
    """The weighted sum of reward functions; picklable when its functions are (module-level ones).

    Example: `WeightedReward(((number_match, 1.0), (format_number, 0.1)))` gives 1.1 for "47"
    when the answer is 47, and 0.1 for "46".
    """

    terms: tuple[tuple[RewardFn, float], ...]
    """(function, weight) pairs."""

    def __call__(self, response_text: str, ground_truth: str) -> float:
        return sum(weight * fn(response_text, ground_truth) for fn, weight in self.terms)
