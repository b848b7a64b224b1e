"""Which config changes a resume may make: `run_changing_differences(saved, new)`.

A resume continues the run that wrote the checkpoint. Settings that only say how long to train, where
and how often to save and log, or how fast to compute (cache sizes, compilation, offloading, reward
workers) may change freely: training longer is a resume. Any other difference (learning rate,
estimator, model, data, sampling...) makes a different run, which `trainer.resume_allow_changes=true`
must confirm.
"""

from __future__ import annotations

from typing import Any

from rlloom.config.loading import task_dict
from rlloom.config.run import RunConfig

FREE_TO_CHANGE: tuple[str, ...] = (
    # How long, where, how often to save, evaluate and log.
    "trainer.total_steps",
    "trainer.save_every",
    "trainer.save_hf_every",
    "trainer.save_weights_only",
    "trainer.keep_last_checkpoints",
    "trainer.eval_every",
    "trainer.run_dir",
    "trainer.resume",
    "trainer.resume_allow_changes",
    "trainer.max_restarts",
    "logging.",
    # Speed and memory only: the same samples and updates (up to floating-point rounding).
    "rollout.num_blocks",
    "rollout.kv_cache_memory_gb",
    "rollout.max_num_seqs",
    "rollout.enforce_eager",
    "rollout.compile",
    "rollout.sleep_during_train",
    "train.compile",
    "train.activation_checkpointing",
    "train.ac_every_k",
    "train.optimizer_offload",
    "train.optimizer_offload_fraction",
    "train.gather_once_per_step",
    "train.logprob_chunk_tokens",
    "train.share_prompts",
    "train.max_tokens_per_micro_batch",
    "reward.num_workers",
    "reward.timeout_s",
    "cluster.timeout_s",
    "cluster.address",
    # The training layout: checkpoints load in any other (tp, ep, dp) with the same continuation.
    "parallel.",
)
"""Dotted settings (a trailing `.` names a whole section) that a resume may change freely."""


def run_changing_differences(saved: RunConfig, new: RunConfig) -> list[str]:
    """Each setting whose value differs between the checkpoint's config and this one, as
    `key: saved -> new`, leaving out the settings of `FREE_TO_CHANGE` and the `data` fields the task
    does not read. Empty when the run is the same."""
    old_flat, new_flat = _flatten(task_dict(saved)), _flatten(task_dict(new))
    return [
        f"{key}: {old_flat.get(key)!r} -> {new_flat.get(key)!r}"
        for key in sorted(old_flat.keys() | new_flat.keys())
        if old_flat.get(key) != new_flat.get(key) and not _is_free(key)
    ]


def _is_free(key: str) -> bool:
    return any(key == free or (free.endswith(".") and key.startswith(free)) for free in FREE_TO_CHANGE)


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
