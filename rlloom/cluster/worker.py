"""`RLWorker`: one rank's colocated training engine and rollout engine.

The same class runs inline in the driver or inside a Ray actor; the worker group decides. Each
method is one stage of the RL step as seen from one rank.
"""

from __future__ import annotations

import torch

from rlloom.algorithms.objective import make_loss_fn
from rlloom.config.components import RunConfig
from rlloom.data.types import PolicyUpdate, RolloutBatch
from rlloom.engines.rollout.native import Completion, NativeEngine, SamplingParams
from rlloom.engines.train.hf_folder import save_hf_folder
from rlloom.engines.train.native import NativeTrainEngine
from rlloom.faults import maybe_fail
from rlloom.models import from_pretrained, load_decoder
from rlloom.weight_sync.colocated import sync_colocated


def resolve_device(cfg: RunConfig, local_rank: int = 0) -> torch.device:
    """The device engines run on: cuda:local_rank when available (or asked for), else cpu."""
    want = cfg.cluster.device
    if want == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "cluster.device='cuda' but no CUDA device is visible. Fix: set cluster.device=auto or cpu."
        )
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def resolve_dtype(cfg: RunConfig, device: torch.device) -> torch.dtype:
    if cfg.model.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.model.dtype]


class RLWorker:
    """A training-engine rank plus a rollout-engine replica on the same device."""

    def __init__(self, cfg: RunConfig, *, rank: int = 0, world_size: int = 1, local_rank: int = 0) -> None:
        self.cfg = cfg
        self.rank, self.world_size = rank, world_size
        self.device = resolve_device(cfg, local_rank)
        self.dtype = dtype = resolve_dtype(cfg, self.device)
        t = cfg.trainer
        total_steps = t.total_steps * t.ppo_epochs * t.num_mini_batches
        self.train = NativeTrainEngine.build(
            cfg.train, cfg.model.path, device=self.device, dtype=dtype, total_steps=total_steps
        )
        # The rollout replica has its own copy of the weights (in the rollout dtype), kept current by
        # the in-place weight sync after every optimizer step.
        self.rollout = NativeEngine.from_config(
            from_pretrained(cfg.model.path, dtype=dtype, device=self.device, fused_projections=True),
            cfg.rollout,
            max_model_len=cfg.data.max_prompt_length + cfg.rollout.max_new_tokens,
            decode=load_decoder(cfg.model.path),
            seed=cfg.trainer.seed,
        )
        self.ref = None
        if cfg.algorithm.kl_coef > 0:
            # The reference is the initial policy: a frozen copy of the starting weights.
            # It never steps, so its optimizer allocates no state.
            self.ref = NativeTrainEngine.build(
                cfg.train, cfg.model.path, device=self.device, dtype=dtype, total_steps=total_steps
            )

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
        return sync_colocated(self.train, self.rollout, dtype=self.dtype).metrics()

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
