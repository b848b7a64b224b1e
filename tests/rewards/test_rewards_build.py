"""build_reward_runner: the configured reward, or the task's default."""

from rlloom.config import RewardConfig
from rlloom.rewards.build import build_reward_runner


def test_default_and_named_rewards():
    runner = build_reward_runner(RewardConfig(), task="arithmetic")
    assert runner.num_workers == 0
    assert runner.score([("12 + 35 = 47", "47"), ("48", "47")]).scores == [1.0, 0.0]
    runner = build_reward_runner(
        RewardConfig(name="number + 0.5*format_number", default_score=-1.0), task="countdown"
    )
    assert runner.score([("47", "47")]).scores == [1.5] and runner.default_score == -1.0
