"""`AnswerRetry`: answer, hear whether it was right, retry. A multi-turn environment that needs no
tool-call training: after each answer the environment says "Correct." (and ends) or "That is not
right. Try again." (up to `rollout.max_turns` answers); the reward is 1 for a right answer, discounted
by `discount` per retry, and 0 when every try was wrong. Scored by the `number` reward's rule (the last
number of the answer equals the row's ground truth).
"""

from __future__ import annotations

from typing import Any

from rlloom.episodes.types import EnvStep
from rlloom.rewards.numbers import number_match


class AnswerRetry:
    def __init__(self, discount: float = 0.5, max_tries: int = 3) -> None:
        self.discount, self.max_tries = discount, max_tries
        self.ground_truth = ""

    def reset(self, row: dict[str, Any]) -> None:
        self.ground_truth = str(row["ground_truth"])
        return None  # the row's prompt is the first message

    def step(self, messages: list[dict[str, Any]], state: dict[str, Any]) -> EnvStep:
        tries = state["tries"] = state.get("tries", 0) + 1
        if number_match(messages[-1]["content"], self.ground_truth) == 1.0:
            return EnvStep(
                done=True, reward=self.discount ** (tries - 1), metrics={"solved": 1.0, "tries": tries}
            )
        if tries >= self.max_tries:
            return EnvStep(done=True, reward=0.0, metrics={"solved": 0.0, "tries": tries})
        return EnvStep(observations=[{"role": "user", "content": "That is not right. Try again."}])
