"""Ray worker group: one actor per GPU (or per CPU slot), each a colocated training rank and rollout
replica, placed with a placement group. Imported only when cluster.mode=ray.

Calls fan out explicitly (every method sends to all actors and waits with the group's timeout);
the controller never blocks longer than `cluster.timeout_s` on any stage. An actor that dies or
hangs raises `WorkerFailure` naming its rank, host and stage; the group then kills the others so
the run stops cleanly and `trainer.resume=auto` can pick up from the last checkpoint.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from typing import Any

import torch

from rlloom.cluster import WorkerFailure
from rlloom.config.components import RunConfig
from rlloom.data.types import PolicyUpdate, RolloutBatch
from rlloom.engines.rollout.native import Completion, SamplingParams

try:
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("cluster.mode=ray needs Ray: pip install 'rlloom[ray]'") from e


class _RankActor:
    """Ray actor body: joins the process group, then holds one `RLWorker`."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.worker: Any = None

    def address(self) -> tuple[str, int, int]:
        """(host ip, a free port on it, pid) for the rendezvous and for error reports."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port, os.getpid()

    def setup(self, cfg: RunConfig, master_addr: str, master_port: int) -> None:
        from rlloom.cluster.worker import RLWorker
        from rlloom.devices import resolve_device
        from rlloom.parallel import init_distributed

        os.environ.update(
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK="0",  # Ray gives each GPU actor its own CUDA_VISIBLE_DEVICES
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
        )
        torch.manual_seed(cfg.trainer.seed)
        init_distributed(resolve_device(cfg).type)
        self.worker = RLWorker(cfg, rank=self.rank, world_size=self.world_size)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.worker, method)(*args, **kwargs)

    def version(self) -> int:
        return self.worker.version


class RayGroup:
    """`cluster.num_workers` actors; the trainer sees the same methods as `InlineGroup`."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.timeout_s = cfg.cluster.timeout_s
        n = cfg.cluster.num_workers
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            env = {k: v for k, v in os.environ.items() if k.startswith(("RLLOOM_", "NCCL_", "TORCH_"))}
            ray.init(
                address=cfg.cluster.address or None,
                runtime_env={"env_vars": env},
                include_dashboard=False,
                log_to_driver=True,
            )
        use_gpu = cfg.cluster.device == "cuda" or (cfg.cluster.device == "auto" and torch.cuda.is_available())
        bundle = {"GPU": 1, "CPU": 1} if use_gpu else {"CPU": 1}
        self.pg = placement_group([bundle] * n, strategy="PACK")
        self._wait([self.pg.ready()], "placement group", ranks=[-1])
        actor_cls = ray.remote(num_cpus=1, num_gpus=1 if use_gpu else 0)(_RankActor)
        self.actors = [
            actor_cls.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i)
            ).remote(i, n)
            for i in range(n)
        ]
        addresses = self._wait([a.address.remote() for a in self.actors], "start")
        self.hosts = [f"{ip} (pid {pid})" for ip, _, pid in addresses]
        master_addr, master_port, _ = addresses[0]
        self._wait([a.setup.remote(cfg, master_addr, master_port) for a in self.actors], "setup")

    # ---- fan-out with timeouts -------------------------------------------------------------------

    def _wait(self, refs: list[Any], stage: str, ranks: list[int] | None = None) -> list[Any]:
        """Results of `refs` in order; the first failure or the deadline raises `WorkerFailure`."""
        ranks = ranks if ranks is not None else list(range(len(refs)))
        index = {ref: i for i, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        deadline = time.monotonic() + self.timeout_s
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(deadline - time.monotonic(), 0))
            if not ready:
                late = [ranks[index[r]] for r in pending]
                self._fail(
                    f"rank(s) {late} on {self._where(late)} did not finish stage {stage!r} within "
                    f"cluster.timeout_s={self.timeout_s:g} s"
                )
            i = index[ready[0]]
            try:
                results[i] = ray.get(ready[0])
            except (RayActorError, RayTaskError, GetTimeoutError) as e:
                self._fail(
                    f"rank {ranks[i]} on {self._where([ranks[i]])} failed in stage {stage!r}: "
                    f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                )
        return results

    def _where(self, ranks: list[int]) -> str:
        hosts = getattr(self, "hosts", None)
        if not hosts or any(r < 0 for r in ranks):
            return "the cluster"
        return ", ".join(hosts[r] for r in ranks)

    def _fail(self, message: str) -> None:
        self.close()
        raise WorkerFailure(
            message + ". The run stopped; restart with trainer.resume=auto to continue "
            "from the last checkpoint."
        )

    def _all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return self._wait([a.call.remote(method, *args, **kwargs) for a in self.actors], method)

    # ---- the WorkerGroup interface -----------------------------------------------------------

    @property
    def version(self) -> int:
        return self._wait([self.actors[0].version.remote()], "version", ranks=[0])[0]

    def generate(self, prompts: list[list[int]], sampling: list[SamplingParams]) -> list[Completion]:
        """Contiguous shares of the prompts to each replica; prompt indices mapped back to global."""
        n = len(self.actors)
        bounds = [len(prompts) * r // n for r in range(n + 1)]
        refs, offsets = [], []
        for actor, lo, hi in zip(self.actors, bounds, bounds[1:]):
            refs.append(actor.call.remote("generate", prompts[lo:hi], sampling[lo:hi]))
            offsets.append(lo)
        out: list[Completion] = []
        for offset, completions in zip(offsets, self._wait(refs, "generate")):
            out += [dataclasses.replace(c, prompt_index=c.prompt_index + offset) for c in completions]
        return out

    def old_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        return self._all("old_logprobs", batch)[0]

    def ref_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        return self._all("ref_logprobs", batch)[0]

    def update_policy(self, update: PolicyUpdate) -> dict[str, float]:
        return self._all("update_policy", update)[0]

    def sync_weights(self) -> dict[str, float]:
        return self._all("sync_weights")[0]

    def sleep_rollout(self) -> None:
        self._all("sleep_rollout")

    def wake_rollout(self) -> None:
        self._all("wake_rollout")

    def save(self, path: str) -> None:
        self._all("save", path)

    def load(self, path: str) -> None:
        self._all("load", path)

    def save_hf(self, path: str) -> None:
        self._all("save_hf", path)

    def close(self) -> None:
        for actor in getattr(self, "actors", []):
            ray.kill(actor, no_restart=True)
        self.actors = []
        if getattr(self, "pg", None) is not None:
            remove_placement_group(self.pg)
            self.pg = None
        if getattr(self, "_owns_ray", False):
            ray.shutdown()  # a later group in this process starts afresh (e.g. a resumed run)
            self._owns_ray = False
