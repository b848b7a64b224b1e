"""Reward functions `(response_text, ground_truth, **columns) -> float` (or batched, see
`rlloom.rewards.calling`) and the runner that applies them safely.

Nothing in this package imports torch: reward worker processes import it and must start fast.
"""

from rlloom.rewards.calling import RewardInput
from rlloom.rewards.registry import BUILTIN_REWARDS, get_reward_fn
from rlloom.rewards.runner import RewardRunner, RewardScores
from rlloom.rewards.weighted import RewardFn, WeightedReward

__all__ = [
    "BUILTIN_REWARDS",
    "RewardFn",
    "RewardInput",
    "RewardRunner",
    "RewardScores",
    "WeightedReward",
    "get_reward_fn",
]
