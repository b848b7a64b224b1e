"""The `parallel` section: the training layout's TP, PP, CP and EP degrees."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlloom.config.checks import check


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    tp: int = 1
    """Tensor-parallel degree: attention heads, MLP width and the vocabulary split over tp ranks.
    Data parallelism is what the degrees leave: cluster.num_workers = pp x dp x cp x tp."""
    pp: int = 1
    """Pipeline-parallel degree (decoder layers split into pp stages); composes with tp, ep and cp."""
    cp: int = 1
    """Context-parallel degree: each packed micro-batch split over cp ranks, every document cut into
    2 x cp chunks balanced by attention cost (rlloom.parallel.cp). Needs train.share_prompts off (its
    default null turns it off with cp > 1)."""
    ep: int = 1
    """Expert-parallel degree (routed experts split over ep ranks, taken from dp x cp x tp; no
    expert-tensor parallelism: split across TP ranks the expert GEMMs get too small to run well)."""
    sequence_parallel: bool = True
    """With tp > 1, keep the residual stream sharded over tokens between blocks (norms and residual
    adds run on a 1/tp share). The engine always runs it with tp > 1: false is refused."""
    pp_schedule: Literal["1f1b", "interleaved", "zero_bubble"] | None = None
    """Pipeline schedule with pp > 1: 1F1B, interleaved 1F1B (pp_virtual_stages per rank), or a
    zero-bubble variant (needs torch >= 2.13: older pipelining fails on rlloom's logprob head).
    null (the default): 1f1b, or interleaved with pp_virtual_stages > 1."""
    pp_virtual_stages: int = 1
    """Stages per pipeline rank for the interleaved schedule (1 = one stage per rank)."""
    pp_first_stage_layers: int = 0
    """Decoder layers of the first pipeline stage (0 = an even split)."""
    pp_last_stage_layers: int = 0
    """Decoder layers of the last pipeline stage (0 = an even split), e.g. a shorter last stage
    that also holds the lm head."""

    @property
    def schedule(self) -> Literal["1f1b", "interleaved", "zero_bubble"]:
        """pp_schedule resolved: null is 1f1b, or interleaved with virtual stages."""
        if self.pp_schedule is not None:
            return self.pp_schedule
        return "interleaved" if self.pp_virtual_stages > 1 else "1f1b"

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "ep", "pp_virtual_stages"):
            value = getattr(self, name)
            check(
                value >= 1, f"parallel.{name}", value, "must be >= 1", f"use parallel.{name}=1 to turn it off"
            )
        for name in ("pp_first_stage_layers", "pp_last_stage_layers"):
            value = getattr(self, name)
            check(value >= 0, f"parallel.{name}", value, "must be >= 0", "use 0 for an even split")
        check(
            self.sequence_parallel or self.tp == 1,
            "parallel.sequence_parallel",
            self.sequence_parallel,
            f"tensor parallelism (parallel.tp={self.tp}) always runs with sequence parallelism here",
            "set parallel.sequence_parallel=true",
        )
        check(
            self.schedule != "1f1b" or self.pp_virtual_stages == 1,
            "parallel.pp_virtual_stages",
            self.pp_virtual_stages,
            "parallel.pp_schedule=1f1b runs one stage per pp rank",
            "use parallel.pp_schedule=interleaved (or zero_bubble) for virtual stages, or pp_virtual_stages=1",
        )
