"""The `reward` section: the reward function and the isolated workers that run plug-ins."""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlloom.config.checks import FLOAT32_MAX, check, check_finite


@dataclass(kw_only=True, slots=True)
class RewardConfig:
    name: str = ""
    """Reward function: a built-in name (number, math, countdown, format_number, ...), a plug-in
    `package.module:function`, or a weighted sum such as `number + 0.1*format_number`; empty picks
    the task's default."""
    num_workers: int = 2
    """Worker processes that run plug-in reward functions, isolated from the trainer: each sample
    under `timeout_s`, each worker in its own process group under `memory_limit_gb`."""
    builtins_in_workers: bool = False
    """Also run the built-in rewards in the workers; off by default because they are trusted and
    about 10x cheaper inline (plug-ins, and sums holding one, always run in workers)."""
    timeout_s: float = 10.0
    """Per-sample timeout (per call for a batched reward function): a sample not scored in time
    scores default_score, and its worker is killed (with every process it started) and replaced."""
    memory_limit_gb: float = 4.0
    """Address-space cap of each worker (RLIMIT_AS), in GiB; an allocation beyond it fails and the
    sample scores default_score. 0 means no cap (needed for a reward model on a GPU)."""
    import_dir: str = ""
    """Folder where plug-in reward modules are also looked for (appended to the import path, so
    no PYTHONPATH is needed): a YAML config file sets it to its own folder; empty means the current
    directory."""
    default_score: float = 0.0
    """Score of a sample whose reward function hung, raised, crashed or returned a non-number (or
    a number outside the float32 range)."""

    def __post_init__(self) -> None:
        check_finite(self, "reward")
        check(
            self.num_workers >= 1,
            "reward.num_workers",
            self.num_workers,
            "must be >= 1 (plug-in rewards always run in worker processes)",
            "use e.g. 2; built-in rewards run inline unless reward.builtins_in_workers=true",
        )
        check(
            math.isfinite(self.timeout_s) and self.timeout_s > 0,
            "reward.timeout_s",
            self.timeout_s,
            "must be a finite number of seconds > 0 (a hung reward must not stall the run)",
            "e.g. 10",
        )
        check(
            math.isfinite(self.memory_limit_gb) and self.memory_limit_gb >= 0,
            "reward.memory_limit_gb",
            self.memory_limit_gb,
            "must be a finite number >= 0",
            "e.g. 4, or 0 for no cap",
        )
        check(
            math.isfinite(self.default_score) and abs(self.default_score) <= FLOAT32_MAX,
            "reward.default_score",
            self.default_score,
            "must be a finite number within the float32 range",
            "e.g. 0",
        )
