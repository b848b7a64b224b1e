"""One process (cluster.mode=inline, the embedded default): a `LocalTrainGroup` of one
`TrainWorker` (and with a critic a `LocalCriticGroup` of one `CriticWorker`) and a
`LocalRolloutGroup` of one `RolloutWorker` on the same device, with the weight
sync in place (`sync_in_place`, which colocated Ray actors use too). Calls run at once; their
`Pending` results are already computed."""

from __future__ import annotations

import torch

from rlloom.cluster.base import Done
from rlloom.config import RunConfig
from rlloom.data.images import ImageInputs
from rlloom.data.types import PolicyUpdate, RolloutBatch, ValueUpdate
from rlloom.engines.rollout import Completion, SamplingParams
from rlloom.heap import freeze_heap
from rlloom.observability.metrics import Metric
from rlloom.weight_sync.base import checksum_enabled
from rlloom.weight_sync.inplace import sync_inplace
from rlloom.workers.critic import CriticWorker
from rlloom.workers.flights import StreamPartial, StreamRequest, StreamResult
from rlloom.workers.rollout import RolloutWorker
from rlloom.workers.train import TrainWorker


class LocalTrainGroup:
    """The one training rank of the run, called directly."""

    def __init__(self, worker: TrainWorker) -> None:
        self.worker = worker

    @property
    def version(self) -> int:
        return self.worker.version

    def old_logprobs(self, batch: RolloutBatch) -> Done[torch.Tensor]:
        return Done(self.worker.old_logprobs(batch))

    def ref_logprobs(self, batch: RolloutBatch) -> Done[torch.Tensor]:
        return Done(self.worker.ref_logprobs(batch))

    def teacher_logprobs(self, batch: RolloutBatch) -> Done[torch.Tensor]:
        return Done(self.worker.teacher_logprobs(batch))

    def update_policy(self, update: PolicyUpdate) -> Done[dict[str, Metric]]:
        return Done(self.worker.update_policy(update))

    def update_sft(self, batch: RolloutBatch, normalizer: float) -> Done[dict[str, Metric]]:
        return Done(self.worker.update_sft(batch, normalizer))

    def offload(self) -> Done[None]:
        return Done(self.worker.offload())

    def onload(self) -> Done[None]:
        return Done(self.worker.onload())

    def freeze_heap(self) -> Done[None]:
        return Done(freeze_heap())

    def save(self, path: str) -> Done[None]:
        return Done(self.worker.save(path))

    def load(self, path: str) -> Done[None]:
        return Done(self.worker.load(path))

    def save_hf(self, path: str) -> Done[None]:
        return Done(self.worker.save_hf(path))

    def close(self) -> None:
        pass


class LocalCriticGroup:
    """The one critic rank of the run, called directly."""

    def __init__(self, worker: CriticWorker) -> None:
        self.worker = worker

    def values(self, batch: RolloutBatch) -> Done[torch.Tensor]:
        return Done(self.worker.values(batch))

    def update_critic(self, update: ValueUpdate) -> Done[dict[str, Metric]]:
        return Done(self.worker.update_critic(update))

    def save(self, path: str) -> Done[None]:
        return Done(self.worker.save(path))

    def load(self, path: str) -> Done[None]:
        return Done(self.worker.load(path))


class LocalRolloutGroup:
    """The one rollout replica of the run, called directly."""

    def __init__(self, worker: RolloutWorker) -> None:
        self.worker = worker

    @property
    def version(self) -> int:
        return self.worker.version

    def generate(
        self,
        prompts: list[list[int]],
        sampling: list[SamplingParams],
        images: list[ImageInputs | None] | None = None,
    ) -> Done[list[Completion]]:
        return Done(self.worker.generate(prompts, sampling, images))

    num_replicas = 1
    restarts = 0

    def stream_add(self, replica: int, requests: list[StreamRequest]) -> None:
        self.worker.stream_add(requests)

    def stream_poll(self, timeout_s: float) -> list[StreamResult | StreamPartial]:
        return self.worker.stream_poll(timeout_s)

    def stream_abort(self) -> int:
        return self.worker.stream_abort()

    def stream_resume(self, keep: bool) -> int:
        return self.worker.stream_resume(keep)

    def stream_drop(self) -> int:
        return self.worker.stream_drop()

    @property
    def stream_busy_s(self) -> float:
        return self.worker.stream_busy()

    def sleep(self) -> Done[None]:
        return Done(self.worker.sleep())

    def wake(self) -> Done[None]:
        return Done(self.worker.wake())

    def freeze_heap(self) -> Done[None]:
        return Done(freeze_heap())

    def close(self) -> None:
        pass


def sync_in_place(cfg: RunConfig, train: TrainWorker, rollout: RolloutWorker) -> dict[str, float]:
    """The training worker's weights into the rollout worker of the same process, under the training
    version (checksummed as `sync.checksum` says); on failure the rollout keeps its version."""
    report = sync_inplace(
        train,
        rollout.engine,
        bucket_bytes=cfg.sync.bucket_mb << 20,
        dtype=train.dtype,
        checksum=checksum_enabled(cfg.sync.checksum, train.device),
    )
    rollout.version = report.version
    return report.metrics()


class LocalSync:
    """In-place weight sync between the two workers of this process."""

    def __init__(self, cfg: RunConfig, source: TrainWorker, sink: RolloutWorker) -> None:
        self.cfg, self.source, self.sink = cfg, source, sink

    def sync(self) -> dict[str, float]:
        return sync_in_place(self.cfg, self.source, self.sink)


def build_local_groups(
    cfg: RunConfig,
) -> tuple[LocalTrainGroup, LocalRolloutGroup, LocalSync, LocalCriticGroup | None]:
    """The training rank, the critic when the estimator needs one, then the rollout replica in the
    same dtype on the same device."""
    train = TrainWorker(cfg)
    critic = LocalCriticGroup(CriticWorker(cfg)) if cfg.algorithm.uses_critic else None
    rollout = RolloutWorker(cfg, device=train.device, dtype=train.dtype)
    return LocalTrainGroup(train), LocalRolloutGroup(rollout), LocalSync(cfg, train, rollout), critic
