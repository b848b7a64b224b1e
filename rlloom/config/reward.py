"""The `reward` section: the reward function and the isolated workers that run plug-ins."""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlloom.config.checks import check, check_finite

MAX_ABS_SCORE = 1e15
"""Largest reward magnitude a run accepts (`reward.default_score`, and every score: the reward
runner's copy is `rlloom.rewards.calling.MAX_ABS_SCORE`, which says why)."""


@dataclass(kw_only=True, slots=True)
class RewardConfig:
    name: str = ""
    """Reward function: a built-in name (number, math, countdown, format_number, ...), a plug-in
    `package.module:function`, or a weighted sum such as `number + 0.1*format_number`; empty picks
    the task's default. `model` names the reward model of `model_path`: `model` alone, or a term such
    as `math + 0.5*model`."""
    model_path: str = ""
    """A Bradley-Terry reward model as transformers saves it (*ForSequenceClassification, num_labels=1,
    with its tokenizer), the `model` term of `name`: it scores the prompt and the response as the
    policy saw them (rendered by the policy's chat template), tokenized by its own tokenizer, forward
    only, in the trainer's process (the GPU when there is one). Metric `reward/model_mean`."""
    model_batch_size: int = 16
    """Conversations per forward of the reward model (padded to the longest of similar lengths)."""
    num_workers: int = 2
    """Worker processes that run plug-in reward functions, isolated from the trainer: each sample
    under `timeout_s`, each worker under `memory_limit_gb`, killed with every process it started."""
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
    directory (where `rlloom train` or `rlloom eval` runs; a recipe's default)."""
    default_score: float = 0.0
    """Score of a sample whose reward function hung, raised, crashed or returned a non-number (or
    a number of magnitude above 1e15, beyond which the group statistics overflow float32)."""

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
            self.model_batch_size >= 1,
            "reward.model_batch_size",
            self.model_batch_size,
            "must be >= 1",
            "use e.g. 16 (lower it if the reward model runs out of memory)",
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
            math.isfinite(self.default_score) and abs(self.default_score) <= MAX_ABS_SCORE,
            "reward.default_score",
            self.default_score,
            f"must be a finite number of magnitude at most {MAX_ABS_SCORE:g} (as every score)",
            "e.g. 0",
        )
