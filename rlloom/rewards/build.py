"""Build a run's `RewardRunner` from its `RewardConfig`.

Plug-in reward code always runs in worker processes (timeout, process-group kill, memory cap). The
built-ins (number, math, countdown, format_*) run inline unless `reward.builtins_in_workers` is set:
they are this package's own code with bounded work per sample (countdown parses at most 200
characters with `ast`, math_verify runs under its own timeouts), and inline they are about 10x
cheaper: scoring 1000 arithmetic responses with `number` takes 14-25 ms inline and 150-175 ms in 2
workers on a 2-core CPU, plus 0.4 s of worker start-up (docs/benchmarks.md, "Rewards: inline vs
worker processes"; benchmarks/bench_rewards.py).

A `model` term of reward.name (the reward model of reward.model_path) is split off the name: the
model runs in this process (`rlloom.rewards.reward_model`, which says why), the rest as above.

Kept out of `rlloom.rewards.__init__` on purpose: reward worker processes import that package,
and they need no config code (nor torch, which the reward model brings).
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from rlloom.config import ConfigError, RewardConfig
from rlloom.rewards.calling import missing_arguments
from rlloom.rewards.registry import MODEL_TERM, get_reward_fn, is_builtin, split_model_term
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
    rule_name, model_weight = check_model_term(reward_cfg, name)
    try:
        fn = get_reward_fn(rule_name, import_dir=reward_cfg.import_dir) if rule_name else None
    except ValueError as e:
        raise ConfigError(f"reward.name={name!r} is invalid: {e}") from e
    model = load_reward_model(reward_cfg) if model_weight else None
    if fn is None:
        return RewardRunner(
            None, default_score=reward_cfg.default_score, model=model, model_weight=model_weight
        )
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
        model=model,
        model_weight=model_weight,
    )


def check_model_term(reward_cfg: RewardConfig, name: str) -> tuple[str, float]:
    """(reward.name without its `model` term, the model's weight), once a `model` term and
    reward.model_path come together (one without the other is a mistake) and the folder looks like a
    reward model (config.json only: before anything loads)."""
    rule_name, model_weight = split_model_term(name)
    path = reward_cfg.model_path
    if model_weight and not path:
        raise ConfigError(
            f"reward.name={name!r} is invalid: its {MODEL_TERM!r} term names the reward model, and "
            "reward.model_path is empty. Fix: set reward.model_path to the reward model's folder."
        )
    if path and not model_weight:
        raise ConfigError(
            f"reward.model_path={path!r} is invalid: reward.name={name!r} has no {MODEL_TERM!r} term, so the "
            f"reward model would load for nothing. Fix: set reward.name={MODEL_TERM} (or e.g. '{name} + "
            f"0.5*{MODEL_TERM}'), or leave reward.model_path empty."
        )
    if path:
        from rlloom.rewards.reward_model import check_reward_model

        try:
            check_reward_model(path)
        except ValueError as e:
            raise ConfigError(f"reward.model_path={path!r} is invalid: {e}.") from None
    return rule_name, model_weight


def load_reward_model(reward_cfg: RewardConfig) -> Callable[[list[str]], list[float]]:
    """The reward model of reward.model_path, loaded forward-only (ConfigError, one line, when it
    does not load)."""
    from rlloom.rewards.reward_model import RewardModel

    try:
        return RewardModel.load(reward_cfg.model_path, batch_size=reward_cfg.model_batch_size)
    except ValueError as e:
        raise ConfigError(f"reward.model_path={reward_cfg.model_path!r} is invalid: {e}.") from None
