"""Build a run's `RewardRunner` from its `RewardConfig`.

Plug-in reward code always runs in worker processes (timeout, process-group kill, memory cap). The
built-ins (number, math, countdown, format_*) run inline unless `reward.builtins_in_workers` is set:
they are this package's own code with bounded work per sample (countdown parses at most 200
characters with `ast`, math_verify runs under its own timeouts), and inline they are about 10x
cheaper: scoring 1000 arithmetic responses with `number` takes 14-25 ms inline and 150-175 ms in 2
workers on a 2-core CPU, plus 0.4 s of worker start-up (docs/benchmarks.md, "Rewards: inline vs
worker processes"; benchmarks/bench_rewards.py).

Kept out of `rlloom.rewards.__init__` on purpose: reward worker processes import that package,
and they need no config code.
"""

from __future__ import annotations

from collections.abc import Collection

from rlloom.config import ConfigError, RewardConfig
from rlloom.rewards.calling import missing_arguments
from rlloom.rewards.registry import get_reward_fn, is_builtin
from rlloom.rewards.runner import RewardRunner
from rlloom.tasks.build import default_reward_name


def build_reward_runner(
    reward_cfg: RewardConfig, *, task: str, columns: Collection[str] | None = None
) -> RewardRunner:
    """The runner for `reward.name`, or for the task's default reward when the name is empty.

    Raises ConfigError when the name does not resolve (an unknown built-in, a module that cannot be
    imported, a missing function) or, given the dataset's `columns`, when the function needs an
    argument that no row has (every call would fail).
    """
    name = reward_cfg.name or default_reward_name(task)
    try:
        fn = get_reward_fn(name, import_dir=reward_cfg.import_dir)
    except ValueError as e:
        raise ConfigError(f"reward.name={name!r} is invalid: {e}") from e
    if columns is not None and (missing := missing_arguments(fn, set(columns))):
        have = ", ".join(sorted(columns)) or "none"
        raise ConfigError(
            f"reward.name={name!r} is invalid: it needs {', '.join(map(repr, missing))}, which no dataset row "
            f"has (the data's columns: {have}); every call would fail. Fix: give the "
            "parameter a default, or add the column to the data."
        )
    inline = is_builtin(fn) and not reward_cfg.builtins_in_workers
    return RewardRunner(
        fn,
        num_workers=0 if inline else reward_cfg.num_workers,
        timeout_s=reward_cfg.timeout_s,
        default_score=reward_cfg.default_score,
        memory_limit_gb=reward_cfg.memory_limit_gb,
    )
