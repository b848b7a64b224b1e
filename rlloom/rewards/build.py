"""Build a run's `RewardRunner` from its `RewardConfig`.

Kept out of `rlloom.rewards.__init__` on purpose: reward worker processes import that package,
and they need no config code.
"""

from __future__ import annotations

from rlloom.config.components import RewardConfig
from rlloom.rewards.registry import get_reward_fn
from rlloom.rewards.runner import RewardRunner
from rlloom.tasks.build import default_reward_name


def build_reward_runner(reward_cfg: RewardConfig, *, task: str) -> RewardRunner:
    """The runner for `reward.name`, or for the task's default reward when the name is empty."""
    name = reward_cfg.name or default_reward_name(task)
    return RewardRunner(
        get_reward_fn(name),
        num_workers=reward_cfg.num_workers,
        timeout_s=reward_cfg.timeout_s,
        default_score=reward_cfg.default_score,
    )
