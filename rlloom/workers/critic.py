"""`CriticWorker`: one rank of the critic of PPO (algorithm.estimator=gae), the value model trained
beside the policy. It lives on a training rank, in the training layout (every training rank hosts
one, called with the same arguments), and holds a value-head training engine with its own optimizer.

The same class runs in the driver (cluster.mode=inline) or inside a Ray actor; the group decides.
"""

from __future__ import annotations

import torch

from rlloom.algorithms.objective import make_value_loss_fn
from rlloom.config import RunConfig
from rlloom.data.types import RolloutBatch, ValueUpdate
from rlloom.devices import resolve_device, resolve_dtype
from rlloom.engines.train.build import build_critic
from rlloom.observability.metrics import Mean, Metric, Sum

_KEPT = {
    "train/loss": "critic/vf_loss",
    "train/grad_norm": "critic/grad_norm",
    "train/lr": "critic/lr",
    "train/skipped_step": "critic/skipped_step",
    "time/train_step_s": "time/critic_step_s",
}


def critic_metrics(values: dict[str, float]) -> dict[str, Metric]:
    """One critic optimizer step's metrics under `critic/`, with the reduction that combines them over
    an RL step's mini-batches and epochs: seconds add up, the loss's per-token parts are weighted by
    their response tokens, per-step values count once per step. The engine's throughput, MFU and
    memory metrics are the policy's business (the critic's step time is `time/critic_step_s`)."""
    tokens = values.get("train/response_tokens", 1.0)
    out: dict[str, Metric] = {}
    for key, v in values.items():
        if key.startswith("critic/"):
            out[key] = Mean(v, weight=tokens)
        elif key == "time/train_step_s":
            out[_KEPT[key]] = Sum(v)
        elif key in _KEPT:
            out[_KEPT[key]] = Mean(v)
    return out


class CriticWorker:
    """One rank of the critic: a value model with its optimizer, in the training layout."""

    def __init__(self, cfg: RunConfig, *, rank: int = 0, local_rank: int = 0) -> None:
        self.cfg = cfg
        self.rank = rank
        self.device = resolve_device(cfg, local_rank)
        self.engine = build_critic(cfg, device=self.device, dtype=resolve_dtype(cfg, self.device))

    # An MoE critic routes by itself (`forward_values`, `train_step` without routing replay):
    # algorithm.routing_replay matches the policy's training to the rollout's routing, and the
    # critic has no rollout to match.

    def values(self, batch: RolloutBatch) -> torch.Tensor:
        """[B, T] values before each response token under the current critic (CPU, fp32, 0 at masked)."""
        return self.engine.forward_values(batch)

    def update_critic(self, update: ValueUpdate) -> dict[str, Metric]:
        """One optimizer step of the clipped value loss on `update`; metrics as `critic_metrics`."""
        loss_fn = make_value_loss_fn(update, clip=self.cfg.critic.value_clip)
        values = self.engine.train_step(update.batch, loss_fn, loss_normalizer=update.normalizer)
        return critic_metrics(values)

    def offload(self) -> None:
        self.engine.offload()

    def onload(self) -> None:
        self.engine.onload()

    def save(self, path: str) -> None:
        self.engine.save(path)

    def load(self, path: str) -> None:
        """Restore the critic (weights, optimizer, version)."""
        self.engine.load(path)
