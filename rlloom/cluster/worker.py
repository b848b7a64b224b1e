"""`RLWorker`: one rank's colocated training engine and rollout engine.

The same class runs inline in the driver or inside a Ray actor; the worker group decides. Each
method is one stage of the RL step as seen from one rank.
"""

from __future__ import annotations

import torch

from rlloom.algorithms.objective import make_loss_fn
from rlloom.config.components import RunConfig
from rlloom.data.types import PolicyUpdate, RolloutBatch
from rlloom.devices import resolve_device, resolve_dtype
from rlloom.engines.rollout import Completion, SamplingParams
from rlloom.engines.rollout.build import build_rollout_engine
from rlloom.engines.train.build import build_reference, build_train_engine
from rlloom.engines.train.hf_folder import save_hf_folder
from rlloom.faults import maybe_fail
from rlloom.weight_sync.inplace import sync_inplace


class RLWorker:
    """A training-engine rank plus a rollout-engine replica on the same device."""

    def __init__(self, cfg: RunConfig, *, rank: int = 0, world_size: int = 1, local_rank: int = 0) -> None:
        self.cfg = cfg
        self.rank, self.world_size = rank, world_size
        self.device = resolve_device(cfg, local_rank)
        self.dtype = dtype = resolve_dtype(cfg, self.device)
        self.train = build_train_engine(cfg, device=self.device, dtype=dtype)
        # The rollout replica has its own copy of the weights (in the rollout dtype), kept current by
        # the in-place weight sync after every optimizer step.
        self.rollout = build_rollout_engine(cfg, device=self.device, dtype=dtype)
        self.ref = None
        if cfg.algorithm.kl_coef > 0:
            # The reference is the initial policy: a frozen copy of the starting weights.
            # It never steps, so its optimizer allocates no state.
            self.ref = build_reference(cfg, device=self.device, dtype=dtype)

    @property
    def _replay(self) -> bool:
        return self.cfg.algorithm.routing_replay == "rollout"

    @property
    def version(self) -> int:
        return self.train.version

    def generate(self, prompts: list[list[int]], sampling: list[SamplingParams]) -> list[Completion]:
        return self.rollout.generate(prompts, sampling)

    def old_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        logp_BT, _ = self.train.forward_logprobs(
            batch, temperature=self.cfg.rollout.temperature, routing_replay=self._replay
        )
        return logp_BT.cpu()

    def ref_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        assert self.ref is not None, "ref_logprobs called without a KL loss"
        logp_BT, _ = self.ref.forward_logprobs(batch, temperature=self.cfg.rollout.temperature)
        return logp_BT.cpu()

    def update_policy(self, update: PolicyUpdate) -> dict[str, float]:
        maybe_fail("update_policy", self.train.version, self.rank)
        loss_fn = make_loss_fn(self.cfg.algorithm, update)
        return self.train.train_step(
            update.batch,
            loss_fn,
            loss_normalizer=update.normalizer,
            temperature=self.cfg.rollout.temperature,
            with_entropy=True,
            routing_replay=self._replay,
        )

    def sleep_rollout(self) -> None:
        self.rollout.sleep()

    def wake_rollout(self) -> None:
        self.rollout.wake()

    def sync_weights(self) -> dict[str, float]:
        return sync_inplace(self.train, self.rollout, dtype=self.dtype).metrics()

    def save(self, path: str) -> None:
        self.train.save(path)

    def load(self, path: str) -> None:
        """Restore the training engine, then make the rollout replica current through the same weight
        sync as after a step (with the restored version). The reference model is not touched: it
        stays the initial policy, as in the uninterrupted run."""
        self.train.load(path)
        self.sync_weights()

    def save_hf(self, path: str) -> None:
        """Write the policy as a Hugging Face folder (every rank gathers, rank 0 writes)."""
        save_hf_folder(self.train, self.cfg.model.path, path, write=self.rank == 0)
