"""Reward functions by name: built-ins, plug-ins by dotted path, and weighted sums of both.

`get_reward_fn(name)` accepts
- a built-in name: `number`, `math`, `countdown`, `choice`, `format_number`, `format_boxed`, `format_answer`;
- a plug-in, "package.module:function": any importable function `(response_text, ground_truth,
  **columns) -> float`, or a batched one `(completions, **columns) -> list[float]` (the calling
  contract is in `rlloom.rewards.calling`). It may also return a bool or an int; the runner turns
  anything that is not a number of magnitude at most 1e15 into the default score and counts it.
  A module next to the YAML config file (`reward.import_dir`) imports without PYTHONPATH;
- a weighted sum of those, e.g. "number + 0.1*format_number" or "my.mod:fn + 0.5*format_answer".

`model` names the reward model of `reward.model_path` (`rlloom.rewards.reward_model`): alone, or as a
term of a sum ("math + 0.5*model"). It is not a function of this registry: `split_model_term` takes
it out of the name, and the runner adds its weighted score to the rest's.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from pathlib import Path

from rlloom.rewards.calling import signature_problem
from rlloom.rewards.choice import choice_match
from rlloom.rewards.countdown import countdown_reward
from rlloom.rewards.format import format_answer, format_boxed, format_number
from rlloom.rewards.math_answer import math_answer
from rlloom.rewards.numbers import number_match
from rlloom.rewards.weighted import RewardFn, WeightedReward

BUILTIN_REWARDS: dict[str, RewardFn] = {
    "number": number_match,
    "math": math_answer,
    "countdown": countdown_reward,
    "choice": choice_match,
    "format_number": format_number,
    "format_boxed": format_boxed,
    "format_answer": format_answer,
}

_TERM = re.compile(r"^\s*(?:(?P<weight>[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*\*\s*)?(?P<name>[\w.:]+)\s*$")


def get_reward_fn(name: str, *, import_dir: str = "") -> RewardFn:
    """The reward function for a built-in name, a "package.module:function" path, or a weighted sum.

    `import_dir` (`reward.import_dir`; empty: the current directory, see `plugin_folder`) is
    appended to the import path before a plug-in module is imported (worker processes get the same
    path).
    """
    terms = name.split("+")
    if len(terms) == 1 and "*" not in name:
        return _resolve(name.strip(), import_dir)
    parsed = []
    for term in terms:
        match = _TERM.match(term)
        if not match:
            raise ValueError(
                f"reward {name!r}: the term {term.strip()!r} is not `name` or `weight*name`; "
                "fix: write e.g. 'number + 0.1*format_number'"
            )
        parsed.append((_resolve(match["name"], import_dir), float(match["weight"] or 1.0)))
    return WeightedReward(tuple(parsed))


MODEL_TERM = "model"
"""The term of reward.name that names the reward model (reward.model_path)."""


def split_model_term(name: str) -> tuple[str, float]:
    """(`name` without its `model` term, the model's weight; 0.0 without one). "math + 0.5*model" ->
    ("math", 0.5); "model" -> ("", 1.0): the model alone. A name that does not parse is returned whole,
    for `get_reward_fn` to report."""
    terms = [_TERM.match(term) for term in name.split("+")]
    if not all(terms):
        return name, 0.0
    model = [float(m["weight"] or 1.0) for m in terms if m["name"] == MODEL_TERM]  # type: ignore[index]
    rest = [m.group(0).strip() for m in terms if m["name"] != MODEL_TERM]  # type: ignore[union-attr,index]
    return " + ".join(rest), sum(model)


def is_builtin(fn: RewardFn) -> bool:
    """True for a built-in reward function, or a weighted sum of built-ins only."""
    if isinstance(fn, WeightedReward):
        return all(is_builtin(term) for term, _ in fn.terms)
    return any(fn is builtin for builtin in BUILTIN_REWARDS.values())


def plugin_folder(import_dir: str) -> str:
    """The folder `reward.import_dir` names: itself, or the current directory when empty (as
    docs/config.md says), the same for `rlloom train`, `rlloom eval` and the start-up checks. A YAML
    file's folder is filled in when the file is read (`rlloom.config.loading`)."""
    return str(Path(import_dir).expanduser().resolve()) if import_dir else os.getcwd()


def _resolve(name: str, import_dir: str) -> RewardFn:
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]
    if ":" not in name:
        raise ValueError(
            f"reward {name!r} is unknown; fix: use a built-in ({', '.join(BUILTIN_REWARDS)}), "
            f"a plug-in path 'package.module:function', or {MODEL_TERM!r} with reward.model_path"
        )
    module_name, _, attr = name.partition(":")
    folder = plugin_folder(import_dir)
    if folder not in sys.path:
        sys.path.append(folder)  # appended: a file next to the config never shadows an installed module
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"reward {name!r}: cannot import module {module_name!r} ({e}); fix: put {module_name}.py next to the "
            "YAML config (or in reward.import_dir), install it, or add its folder to PYTHONPATH"
        ) from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(
            f"reward {name!r}: module {module_name!r} has no function {attr!r}; fix: check the name"
        )
    if problem := signature_problem(fn):
        raise ValueError(
            f"reward {name!r}: {problem}; fix: define it as def {attr}(response_text, ground_truth, **kwargs), "
            "or with a `completions` parameter to score batches"
        )
    return fn
