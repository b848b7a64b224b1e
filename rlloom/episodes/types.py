"""The records an environment hands back (`EnvStep`) and the check that turns whatever a user's
`step` returned into one, or says why it cannot."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

Message = dict[str, Any]
"""A chat message: {"role": ..., "content": ...} (an assistant message may carry "tool_calls")."""

OBSERVATION_ROLES = ("tool", "user")
"""Roles an environment may append: tool output, or the user's next message."""


@dataclass(kw_only=True, slots=True)
class EnvStep:
    """What `env.step(messages, state)` returns. Example:
    `EnvStep(observations=[{"role": "user", "content": "Wrong, try again."}], reward=None, done=False)`."""

    observations: list[Message] = field(default_factory=list)
    """Chat messages to append (role `tool` or `user`); ignored when `done`."""
    reward: float | None = None
    """The trajectory's reward when `done` (None: the configured reward function scores it)."""
    done: bool = False
    """The trajectory ends here."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Floats averaged over the step's trajectories into `env/<name>`."""


def as_env_step(value: object) -> EnvStep:
    """`value` (an `EnvStep` or a dict with its fields) checked; raises TypeError naming the problem."""
    if isinstance(value, dict):
        unknown = set(value) - {"observations", "reward", "done", "metrics"}
        if unknown:
            raise TypeError(f"step() returned a dict with unknown keys {sorted(unknown)}")
        value = EnvStep(**value)
    if not isinstance(value, EnvStep):
        raise TypeError(f"step() returned {type(value).__name__}, not an EnvStep or a dict")
    if not isinstance(value.done, bool):
        raise TypeError(f"step() returned done={value.done!r}, not a bool")
    if value.reward is not None:
        if isinstance(value.reward, bool) or not isinstance(value.reward, (int, float)):
            raise TypeError(f"step() returned reward={value.reward!r}, not a float or None")
        if not math.isfinite(value.reward):
            raise TypeError(f"step() returned a non-finite reward {value.reward!r}")
    value.observations = check_messages(value.observations, "step() observations")
    if not isinstance(value.metrics, dict) or not all(
        isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        for k, v in value.metrics.items()
    ):
        raise TypeError(f"step() returned metrics={value.metrics!r}, not a dict of finite floats")
    return value


def check_messages(messages: object, what: str, roles: tuple[str, ...] = OBSERVATION_ROLES) -> list[Message]:
    """`messages` as a list of chat messages with a role from `roles` and text content."""
    if not isinstance(messages, list):
        raise TypeError(f"{what} is {type(messages).__name__}, not a list of chat messages")
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in roles or not isinstance(m.get("content"), str):
            raise TypeError(f"{what}: {m!r} is not a message with role in {roles} and string content")
    return [dict(m) for m in messages]
