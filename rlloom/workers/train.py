"""`TrainWorker`: one training rank. It holds the policy's training engine (with its optimizer), the
frozen reference policy when the loss has a KL term, the frozen teacher of on-policy distillation
(`teacher.path`), and is the weight source of the weight sync.

The same class runs in the driver (cluster.mode=inline) or inside a Ray actor; the group decides.
Each method is one stage of the RL step as seen from one rank; every rank of the training world
is called with the same arguments.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from rlloom.algorithms.objective import make_loss_fn
from rlloom.algorithms.sft import make_sft_loss_fn
from rlloom.config import RunConfig
from rlloom.data.types import PolicyUpdate, RolloutBatch
from rlloom.devices import resolve_device, resolve_dtype
from rlloom.engines.train.base import ForwardOptions, WeightLayout
from rlloom.engines.train.build import build_reference, build_teacher, build_train_engine
from rlloom.engines.train.hf_folder import save_hf_folder
from rlloom.faults import maybe_fail
from rlloom.observability.metrics import Max, Mean, Metric, Sum

_SUMS = ("train/tokens", "train/computed_tokens", "train/response_tokens", "time/train_step_s")
_MAXES = ("memory/", "train/num_micro_batches", "moe/load_max_over_mean", "rollout/logp_gap_max")
_PER_TOKEN = ("loss/", "actor/", "rollout/", "moe/route_mismatch_frac")


def update_metrics(values: dict[str, float]) -> dict[str, Metric]:
    """One optimizer step's metrics with the reduction that combines them over the mini-batches and
    epochs of an RL step: token counts and seconds add up, peaks and micro-batch counts take the
    max, per-token means are weighted by the response tokens behind them, and per-optimizer-step
    values (loss, gradient norm, learning rate, skipped fraction, rates) count once per step."""
    tokens = values.get("train/response_tokens", 1.0)
    out: dict[str, Metric] = {}
    for key, v in values.items():
        if key.startswith(_SUMS):
            out[key] = Sum(v)
        elif key.startswith(_MAXES):
            out[key] = Max(v)
        elif key.startswith(_PER_TOKEN):
            out[key] = Mean(v, weight=tokens)
        else:
            out[key] = Mean(v)
    return out


class TrainWorker:
    """One rank of the training world: the policy engine, the reference, the teacher, the weight source."""

    def __init__(self, cfg: RunConfig, *, rank: int = 0, local_rank: int = 0) -> None:
        self.cfg = cfg
        self.rank = rank
        self.device = resolve_device(cfg, local_rank)
        self.dtype = resolve_dtype(cfg, self.device)
        self.engine = build_train_engine(cfg, device=self.device, dtype=self.dtype)
        # The reference is the initial policy, forward-only (only `forward_logprobs` is called on it).
        self.ref = (
            build_reference(cfg, device=self.device, dtype=self.dtype) if cfg.algorithm.kl_coef > 0 else None
        )
        # The teacher is built the same way, from teacher.path; with teacher.offload it waits on the host.
        self.teacher = build_teacher(cfg, device=self.device, dtype=self.dtype) if cfg.uses_teacher else None
        if self.teacher is not None and cfg.teacher.offload:
            self.teacher.offload()

    @property
    def version(self) -> int:
        """Optimizer steps applied: the policy version of the training weights."""
        return self.engine.version

    def _options(self, *, with_entropy: bool = False) -> ForwardOptions:
        """The policy's forward: at the rollout's temperature, routed as the rollout was when asked."""
        return ForwardOptions(
            temperature=self.cfg.rollout.temperature,
            with_entropy=with_entropy,
            routing_replay=self.cfg.algorithm.routing_replay == "rollout",
        )

    def old_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        """[B, T] logprobs of the response tokens under the current policy (CPU, fp32)."""
        logp_BT, _ = self.engine.forward_logprobs(batch, self._options())
        return logp_BT.cpu()

    def ref_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        """[B, T] logprobs of the response tokens under the reference policy (CPU, fp32)."""
        if self.ref is None:
            raise RuntimeError(
                "ref_logprobs needs the reference policy, built only when algorithm.kl_coef > 0"
            )
        logp_BT, _ = self.ref.forward_logprobs(
            batch, ForwardOptions(temperature=self.cfg.rollout.temperature)
        )
        return logp_BT.cpu()

    def teacher_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        """[B, T] logprobs of the response tokens under the teacher (CPU, fp32), at the rollout's
        temperature as the student's; with teacher.offload its weights visit the device for this call."""
        if self.teacher is None:
            raise RuntimeError("teacher_logprobs needs the teacher, built only when the run distills")
        offload = self.cfg.teacher.offload
        if offload:
            self.teacher.onload()
        logp_BT, _ = self.teacher.forward_logprobs(
            batch, ForwardOptions(temperature=self.cfg.rollout.temperature)
        )
        if offload:
            self.teacher.offload()
        return logp_BT.cpu()

    def update_policy(self, update: PolicyUpdate) -> dict[str, Metric]:
        """One optimizer step on `update`; its metrics carry their reductions (`update_metrics`)."""
        maybe_fail("update_policy", self.engine.version, self.rank)
        loss_fn = make_loss_fn(self.cfg.algorithm, update)
        values = self.engine.train_step(
            update.batch,
            loss_fn,
            loss_normalizer=update.normalizer,
            options=self._options(with_entropy=True),
        )
        return update_metrics(values)

    def update_sft(self, batch: RolloutBatch, normalizer: float) -> dict[str, Metric]:
        """One optimizer step of supervised fine-tuning (`rlloom sft`) on `batch`, whose loss mask marks
        the assistant tokens; `normalizer`: the whole batch's (`rlloom.algorithms.sft.sft_normalizer`)."""
        maybe_fail("update_policy", self.engine.version, self.rank)
        loss_fn = make_sft_loss_fn(batch.response_mask(), self.cfg.algorithm.agg_mode)
        values = self.engine.train_step(batch, loss_fn, loss_normalizer=normalizer)  # temperature 1
        return update_metrics(values)

    def named_weights(
        self,
        *,
        bucket_bytes: int,
        dtype: torch.dtype | None = None,
        owned_only: bool = False,
        lazy_cast: bool = False,
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The weight source of the sync: buckets of (Hugging Face name, full tensor). Every rank must
        consume the generator (it gathers the shards). `owned_only`: this rank's routed experts only
        and its TP shard of each tensor-parallel tensor, without an all-gather over the expert- or
        tensor-parallel ranks (the broadcast sync)."""
        return self.engine.named_weights(
            bucket_bytes=bucket_bytes, dtype=dtype, owned_only=owned_only, lazy_cast=lazy_cast
        )

    def weight_layouts(self) -> dict[str, WeightLayout]:
        """Per Hugging Face name: full shape, for a routed expert the EP rank that holds it, for a
        tensor-parallel tensor its TP shard dim."""
        return self.engine.weight_layouts()

    @property
    def ep_rank(self) -> int:
        """This rank's expert-parallel rank (0 without expert parallelism)."""
        return self.engine.ep_rank

    @property
    def tp_rank(self) -> int:
        """This rank's tensor-parallel rank (0 without tensor parallelism)."""
        return self.engine.tp_rank

    def offload(self) -> None:
        """Move the policy's parameters, gradients and optimizer state to the host."""
        self.engine.offload()

    def onload(self) -> None:
        self.engine.onload()

    def save(self, path: str) -> None:
        self.engine.save(path)
        maybe_fail("save", self.engine.version, self.rank)

    def load(self, path: str) -> None:
        """Restore the policy (weights, optimizer, version). The reference is not touched: it stays
        the initial policy, as in the uninterrupted run."""
        self.engine.load(path)

    def save_hf(self, path: str) -> None:
        """Write the policy as a Hugging Face folder (every rank gathers, rank 0 writes)."""
        save_hf_folder(self.engine, self.cfg.model.path, path, write=self.rank == 0)
