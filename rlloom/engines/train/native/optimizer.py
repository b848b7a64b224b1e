"""AdamW over the engine's parameters, optionally with part of the step on CPU (optimizer offload).

Parameters with fewer than 2 dimensions (norm weights, biases) get no weight decay. With
`optimizer_offload`, the first `optimizer_offload_fraction` of the parameters (by element count, in
model order) keep their fp32 master copy and AdamW state in CPU memory: each step copies their
gradients down, runs AdamW on CPU, and copies the updated values back into the (possibly sharded)
device parameters. The rest step on the device as usual. Both halves see the same learning rate.

The CPU half runs on torch's intra-op threads, and launchers leave one: torchrun and Ray actors set
OMP_NUM_THREADS=1 by default. On 2 x H200 (Qwen3-30B-A3B width, 24 layers, half of each rank's
parameters on CPU) that made a step take 67 s. So an engine with a CPU half raises its threads to
its share of the host's cores (`offload_threads`), as DeepSpeed's CPU Adam uses every core.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from rlloom.config import TrainEngineConfig
from rlloom.engines.train.native.step_guard import StepGuard

log = logging.getLogger(__name__)


def offload_threads(cores: int, ranks_on_host: int) -> int:
    """CPU threads for one rank's CPU AdamW: its share of the host's cores (at least 1)."""
    return max(1, cores // max(1, ranks_on_host))


def ranks_on_this_host(group: dist.ProcessGroup | None = None) -> int:
    """How many ranks of `group` (default: the world) run on this host; 1 without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    hosts: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    return hosts.count(socket.gethostname())


def _raise_cpu_threads() -> None:
    """Give torch this rank's share of the host's cores, when it has fewer (a collective: every rank)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = offload_threads(cores, ranks_on_this_host())
    if torch.get_num_threads() < threads:
        log.info("optimizer offload: CPU AdamW on %d threads (was %d)", threads, torch.get_num_threads())
        torch.set_num_threads(threads)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _adamw(params: Sequence[nn.Parameter], cfg: TrainEngineConfig) -> torch.optim.AdamW | None:
    if not params:
        return None
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [g for g in ({"params": decay}, {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    # The fused kernel exists for CUDA and CPU and is the fastest of the three implementations;
    # both halves of an offloaded optimizer use it, so they compute bit for bit the same update.
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.adam_eps, weight_decay=cfg.weight_decay, fused=True
    )


class EngineOptimizer:
    """AdamW on the device for some parameters and on CPU for the offloaded rest.

    `named_params`: (name, parameter) in model order; names key the offloaded state in checkpoints.
    """

    def __init__(self, named_params: Sequence[tuple[str, nn.Parameter]], cfg: TrainEngineConfig) -> None:
        total = sum(p.numel() for _, p in named_params)
        budget = cfg.optimizer_offload_fraction * total if cfg.optimizer_offload else 0.0
        seen = 0
        on_device: list[nn.Parameter] = []
        self.offloaded: list[tuple[str, nn.Parameter, nn.Parameter]] = []
        for name, p in named_params:
            if seen < budget:
                self.offloaded.append((name, p, self._master_copy(p)))
            else:
                on_device.append(p)
            seen += p.numel()
        self.params = [p for _, p in named_params]
        self.device_optim = _adamw(on_device, cfg)
        self.cpu_optim = _adamw([m for _, _, m in self.offloaded], cfg)
        self.guard = StepGuard()
        """Certifies each step finite before it is applied (step.py), carrying its bounds."""
        if cfg.optimizer_offload:  # every rank takes this branch, so the collective inside is safe
            _raise_cpu_threads()

    @staticmethod
    def _master_copy(p: nn.Parameter) -> nn.Parameter:
        local = _local(p.detach())
        master = torch.empty(local.shape, dtype=torch.float32, device="cpu", pin_memory=local.is_cuda)
        master.copy_(local)
        return nn.Parameter(master)

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [o for o in (self.device_optim, self.cpu_optim) if o is not None]

    def set_lr(self, lr: float) -> None:
        for optim in self.optimizers:
            for group in optim.param_groups:
                group["lr"] = lr

    def stage_grads(self) -> None:
        """Copy the offloaded parameters' gradients to their CPU master copies (before `step`)."""
        if self.cpu_optim is None:
            return
        for _, p, master in self.offloaded:
            if p.grad is None:
                master.grad = None
                continue
            if master.grad is None:
                master.grad = torch.empty_like(master, pin_memory=master.is_pinned())
            master.grad.copy_(_local(p.grad), non_blocking=True)
        if torch.cuda.is_available() and any(master.is_pinned() for _, _, master in self.offloaded):
            torch.cuda.current_stream().synchronize()  # gradients must have landed before the CPU step

    def step(self) -> None:
        """One AdamW step of both halves (after `stage_grads`)."""
        if self.device_optim is not None:
            self.device_optim.step()
        if self.cpu_optim is None:
            return
        self.cpu_optim.step()
        for _, p, master in self.offloaded:
            # From pinned memory this copy is asynchronous and stream-ordered before the next forward.
            _local(p.detach()).copy_(master.detach(), non_blocking=True)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        for _, _, master in self.offloaded:
            master.grad = None

    def move_state(self, device: torch.device | str) -> None:
        """Move the device optimizer's state (not the CPU half's) to `device`; for offload/onload."""
        if self.device_optim is None:
            return
        for state in self.device_optim.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):  # the fused kernel keeps `step` on the device too
                    state[key] = value.to(device, non_blocking=True)

    def _ensure_cpu_state(self) -> None:
        # AdamW creates its state on the first step; checkpoints need it to exist before (to load into).
        assert self.cpu_optim is not None
        for _, _, master in self.offloaded:
            state = self.cpu_optim.state[master]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)

    def offloaded_state_dict(self) -> dict[str, torch.Tensor]:
        """The CPU half's AdamW state under `offload_optim.<param name>.<key>` for a checkpoint.

        Sharded parameters' states are wrapped as DTensors with the parameter's layout, so the
        checkpoint holds full tensors whatever the number of ranks.
        """
        if self.cpu_optim is None:
            return {}
        self._ensure_cpu_state()
        out: dict[str, torch.Tensor] = {}
        for name, p, master in self.offloaded:
            for key, value in self.cpu_optim.state[master].items():
                if isinstance(p, DTensor) and value.dim() > 0:
                    value = DTensor.from_local(
                        value, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
                    )
                out[f"offload_optim.{name}.{key}"] = value
        return out

    def load_offloaded_state_dict(self, loaded: dict[str, torch.Tensor]) -> None:
        """Copy a loaded `offloaded_state_dict()` into the CPU half's state (and refresh the masters)."""
        if self.cpu_optim is None:
            return
        self._ensure_cpu_state()
        for name, p, master in self.offloaded:
            for key, value in self.cpu_optim.state[master].items():
                value.copy_(_local(loaded[f"offload_optim.{name}.{key}"]))
            master.detach().copy_(_local(p.detach()))
