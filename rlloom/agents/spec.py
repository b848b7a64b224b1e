"""`AgentSpec`: how a worker runs one trajectory's agent (`rollout.agent: "module:function"`), and the
check of what the agent returned.

The agent is `[async] def run_agent(base_url: str, row: dict, sampling: dict) -> float | dict | None`:
it may call the session's base URL any number of times with any OpenAI client, and returns the
reward (a float, or `{"reward": ..., "metrics": {...}}`), or None to let the configured reward
function score the session's final answer. It runs in an environment worker (episodes/calls.py's
`EnvCalls`, `rollout.env_workers` processes; 0: threads of the trainer) with a deadline of
`rollout.agent_timeout_s`: a raise, a hang, an exit or a result of another shape fails only its
trajectory.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from dataclasses import dataclass, field
from typing import Any

from rlloom.episodes.calls import import_object


@dataclass(frozen=True, slots=True)
class AgentResult:
    """What an agent returned, checked."""

    reward: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)


def as_agent_result(value: object) -> AgentResult:
    """`value` (None, a number, or a dict of `reward` and `metrics`) checked; TypeError naming the problem."""
    if value is None:
        return AgentResult()
    if isinstance(value, dict):
        unknown = set(value) - {"reward", "metrics"}
        if unknown:
            raise TypeError(f"the agent returned a dict with unknown keys {sorted(unknown)}")
        reward, metrics = value.get("reward"), value.get("metrics") or {}
    else:
        reward, metrics = value, {}
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))):
        raise TypeError(f"the agent returned {reward!r}, not a float, a dict or None")
    if reward is not None and not math.isfinite(reward):
        raise TypeError(f"the agent returned a non-finite reward {reward!r}")
    if not isinstance(metrics, dict) or not all(
        isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        for k, v in metrics.items()
    ):
        raise TypeError(f"the agent returned metrics={metrics!r}, not a dict of finite floats")
    return AgentResult(reward=None if reward is None else float(reward), metrics=dict(metrics))


async def _await(value: Any) -> Any:
    return await value


@dataclass(frozen=True, slots=True)
class AgentSpec:
    """`rollout.agent` and where to import it from (picklable: worker processes run from it)."""

    agent: str
    import_dir: str = ""

    @property
    def what(self) -> str:
        return self.agent

    def preload(self) -> None:
        """Import the agent's module (a worker does so before it says it is ready)."""
        import_object(self.agent, setting="rollout.agent", import_dir=self.import_dir)

    def build(self) -> None:
        return None  # an agent keeps its own state: the worker has no environment to carry

    def call(self, env: Any, state: dict[str, Any], method: str, arg: Any) -> AgentResult:
        """Run the agent on `arg` = (base_url, row, sampling) to its end."""
        fn = import_object(self.agent, setting="rollout.agent", import_dir=self.import_dir)
        value = fn(*arg)
        if inspect.isawaitable(value):
            value = asyncio.run(_await(value))
        return as_agent_result(value)

    def check(self) -> None:
        """Start-up check before the model loads: the agent imports and takes (base_url, row, sampling)."""
        fn = import_object(self.agent, setting="rollout.agent", import_dir=self.import_dir)
        if not callable(fn) or inspect.isclass(fn):
            raise ValueError(f"rollout.agent={self.agent!r} is not a function; fix: name an (async) function")
        try:
            inspect.signature(fn).bind(None, None, None)
        except TypeError as e:
            raise ValueError(
                f"rollout.agent={self.agent!r} has the wrong signature ({e}); fix: define "
                "async def run_agent(base_url, row, sampling)"
            ) from e
