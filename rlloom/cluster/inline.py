"""The inline worker group: one `RLWorker` in the driver process (the embedded default).

`WorkerGroup` is the interface the trainer talks to; the Ray group implements the same methods by
fanning out to actors and merging their results, so the trainer never knows which one it has.
"""

from __future__ import annotations

from typing import Protocol

import torch

from rlloom.config.components import RunConfig
from rlloom.data.types import PolicyUpdate, RolloutBatch
from rlloom.engines.rollout.native import Completion, SamplingParams


class WorkerGroup(Protocol):
    """What the RL loop needs from its workers (all calls block, with the group's timeout)."""

    @property
    def version(self) -> int: ...

    def generate(self, prompts: list[list[int]], sampling: list[SamplingParams]) -> list[Completion]: ...

    def old_logprobs(self, batch: RolloutBatch) -> torch.Tensor: ...

    def ref_logprobs(self, batch: RolloutBatch) -> torch.Tensor: ...

    def update_policy(self, update: PolicyUpdate) -> dict[str, float]: ...

    def sync_weights(self) -> dict[str, float]: ...

    def sleep_rollout(self) -> None: ...

    def wake_rollout(self) -> None: ...

    def save(self, path: str) -> None: ...

    def load(self, path: str) -> None:
        """Restore every rank's training engine; the rollout replicas then hold the restored weights
        and version (RLWorker.load syncs them)."""
        ...

    def save_hf(self, path: str) -> None: ...

    def close(self) -> None: ...


class InlineGroup:
    """One worker, called directly."""

    def __init__(self, cfg: RunConfig) -> None:
        from rlloom.cluster.worker import RLWorker

        self.worker = RLWorker(cfg)

    @property
    def version(self) -> int:
        return self.worker.version

    def generate(self, prompts: list[list[int]], sampling: list[SamplingParams]) -> list[Completion]:
        return self.worker.generate(prompts, sampling)

    def old_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        return self.worker.old_logprobs(batch)

    def ref_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        return self.worker.ref_logprobs(batch)

    def update_policy(self, update: PolicyUpdate) -> dict[str, float]:
        return self.worker.update_policy(update)

    def sync_weights(self) -> dict[str, float]:
        return self.worker.sync_weights()

    def sleep_rollout(self) -> None:
        self.worker.sleep_rollout()

    def wake_rollout(self) -> None:
        self.worker.wake_rollout()

    def save(self, path: str) -> None:
        self.worker.save(path)

    def load(self, path: str) -> None:
        self.worker.load(path)

    def save_hf(self, path: str) -> None:
        self.worker.save_hf(path)

    def close(self) -> None:
        pass


def build_worker_group(cfg: RunConfig) -> WorkerGroup:
    """Inline for one worker; Ray (imported only then) for cluster.mode=ray."""
    if cfg.cluster.mode == "ray":
        from rlloom.cluster.ray import RayGroup

        return RayGroup(cfg)
    return InlineGroup(cfg)
