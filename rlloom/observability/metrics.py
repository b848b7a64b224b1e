"""Metric values that carry their reduction, and the accumulator that reduces them correctly.

A metric is recorded as `Mean(value, weight)`, `Sum(value)`, `Max(value)` or `Min(value)`, so
whoever aggregates it (over micro-batches, mini-batches, steps or data-parallel ranks) knows how:

- `Mean`: weighted by `weight` (e.g. the token or sample count behind the value), so the mean of
  means equals the mean over all the underlying items, however the work was split;
- `Sum`: sum of sums (token counts, dropped samples);
- `Max` / `Min`: max of maxes, min of mins (peak memory, slowest stage).

Keys are named `component/quantity_unit`, e.g. `perf/rollout_tok_per_s`, `time/generate_s`,
`loss/ratio_clipped_frac`.

    acc = MetricsAccumulator()
    for mb in micro_batches:
        acc.add({"loss/policy": Mean(loss_mb, weight=num_tokens_mb), "perf/tokens": Sum(num_tokens_mb)})
    logged = reduce_across_ranks(acc)   # {"loss/policy": ..., "perf/tokens": ...}; no-op without dist
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal, Union

import torch
import torch.distributed as dist

Reduction = Literal["mean", "sum", "max", "min"]


@dataclass(frozen=True, slots=True)
class Mean:
    """A value averaged with `weight` (the number of items it is the mean of)."""

    value: float
    weight: float = 1.0


@dataclass(frozen=True, slots=True)
class Sum:
    """A value summed across records."""

    value: float


@dataclass(frozen=True, slots=True)
class Max:
    """A value reduced by maximum across records."""

    value: float


@dataclass(frozen=True, slots=True)
class Min:
    """A value reduced by minimum across records."""

    value: float


Metric = Union[Mean, Sum, Max, Min]

_REDUCTION: dict[type, Reduction] = {Mean: "mean", Sum: "sum", Max: "max", Min: "min"}


def check_key(key: str) -> None:
    """Raise ValueError unless `key` looks like `component/quantity_unit` (no spaces, a '/')."""
    parts = key.split("/")
    if len(parts) < 2 or not all(parts) or any(c.isspace() for c in key):
        raise ValueError(
            f"metric key {key!r} is invalid: keys are named component/quantity_unit with no spaces. "
            "Fix: use e.g. 'perf/rollout_tok_per_s' or 'time/generate_s'."
        )


def _as_float(value: float | torch.Tensor, key: str) -> float:
    # A 0-d tensor is accepted for convenience; float() syncs with the GPU once per value.
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"metric {key!r} got a tensor of shape {tuple(value.shape)}: a metric value must be a "
                "scalar. Fix: reduce it first (e.g. Mean(x.mean(), weight=x.numel()))."
            )
        return float(value.detach().item())
    return float(value)


@dataclass(slots=True)
class _State:
    reduction: Reduction
    total: float  # mean: sum of value*weight; sum: running sum; max/min: running extreme
    weight: float = 0.0  # mean only: sum of weights


class MetricsAccumulator:
    """Aggregates many records of `{key: Metric}` into one value per key.

    A key keeps the reduction it was first recorded with; recording it with another raises.
    """

    def __init__(self) -> None:
        self._states: dict[str, _State] = {}

    def add(self, metrics: Mapping[str, Metric]) -> None:
        """Fold one record (e.g. one micro-batch's metrics) into the running aggregate."""
        for key, metric in metrics.items():
            reduction = _REDUCTION.get(type(metric))
            if reduction is None:
                raise ValueError(
                    f"metric {key!r} is a {type(metric).__name__}: values must carry their reduction. "
                    "Fix: wrap it as Mean(v, weight), Sum(v), Max(v) or Min(v)."
                )
            value = _as_float(metric.value, key)
            weight = _as_float(metric.weight, key) if isinstance(metric, Mean) else 0.0
            self._fold(key, reduction, value, weight)

    def add_all(self, records: Iterable[Mapping[str, Metric]]) -> None:
        """`add` each record in turn."""
        for record in records:
            self.add(record)

    def merge(self, other: MetricsAccumulator) -> None:
        """Fold another accumulator into this one (e.g. per-step aggregates into a run total)."""
        for key, state in other._states.items():
            if state.reduction == "mean":
                # _fold multiplies value by weight; pass the weighted total back as a mean.
                if state.weight > 0:
                    self._fold(key, "mean", state.total / state.weight, state.weight)
                else:
                    self._fold(key, "mean", 0.0, 0.0)
            else:
                self._fold(key, state.reduction, state.total, 0.0)

    def _fold(self, key: str, reduction: Reduction, value: float, weight: float) -> None:
        state = self._states.get(key)
        if state is None:
            check_key(key)
            if reduction == "mean":
                self._check_weight(key, weight)
                self._states[key] = _State("mean", value * weight, weight)
            else:
                self._states[key] = _State(reduction, value)
            return
        if state.reduction != reduction:
            raise ValueError(
                f"metric {key!r} was recorded with reduction {state.reduction!r} and now with "
                f"{reduction!r}: a key has one reduction. Fix: use one of Mean/Sum/Max/Min for it everywhere."
            )
        if reduction == "mean":
            self._check_weight(key, weight)
            state.total += value * weight
            state.weight += weight
        elif reduction == "sum":
            state.total += value
        elif reduction == "max":
            state.total = max(state.total, value)
        else:
            state.total = min(state.total, value)

    @staticmethod
    def _check_weight(key: str, weight: float) -> None:
        if not (weight >= 0 and math.isfinite(weight)):
            raise ValueError(
                f"Mean weight of metric {key!r} is {weight}: weights must be finite and >= 0. "
                "Fix: pass the count of items behind the mean (tokens, samples)."
            )

    def reductions(self) -> dict[str, Reduction]:
        """The reduction of every key recorded so far."""
        return {key: state.reduction for key, state in self._states.items()}

    def summary(self) -> dict[str, float]:
        """One float per key. A Mean whose total weight is 0 (nothing behind it) is left out."""
        out: dict[str, float] = {}
        for key, state in self._states.items():
            if state.reduction == "mean":
                if state.weight > 0:
                    out[key] = state.total / state.weight
            else:
                out[key] = state.total
        return out

    def reset(self) -> None:
        """Forget everything (start of a new step)."""
        self._states.clear()

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, key: str) -> bool:
        return key in self._states


def reduce_across_ranks(acc: MetricsAccumulator, group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """Reduce `acc` over the ranks of `group` and return the global summary on every rank.

    Means are reduced as all-reduced (sum of value*weight) / (sum of weights), sums as sums, maxes
    and mins as maxes and mins, so the result equals one accumulator fed every rank's records. Ranks
    may hold different keys (a metric only some ranks saw); the key sets are unioned first. Every
    rank of the group must call this (it is a collective). Without an initialised process group (or
    with one rank) this is `acc.summary()`.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return acc.summary()

    local = acc.reductions()
    gathered: list[dict[str, Reduction] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, local, group=group)
    union: dict[str, Reduction] = {}
    for rank_keys in gathered:
        for key, reduction in (rank_keys or {}).items():
            if union.setdefault(key, reduction) != reduction:
                raise ValueError(
                    f"metric {key!r} is recorded as {union[key]!r} on one rank and {reduction!r} on "
                    "another: a key has one reduction. Fix: record it with the same type on every rank."
                )
    keys = sorted(union)

    # NCCL only reduces CUDA tensors; gloo reduces CPU tensors.
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    sums = [k for k in keys if union[k] in ("mean", "sum")]
    extremes = [k for k in keys if union[k] in ("max", "min")]
    states = acc._states

    # One all-reduce of sums: [mean totals and sum totals..., mean weights...].
    means = [k for k in sums if union[k] == "mean"]
    sum_vals = [states[k].total if k in states else 0.0 for k in sums]
    sum_vals += [states[k].weight if k in states else 0.0 for k in means]
    # One all-reduce of maxes: a min is the negated max of negated values; absent keys are -inf.
    ext_vals = []
    for k in extremes:
        sign = 1.0 if union[k] == "max" else -1.0
        ext_vals.append(sign * states[k].total if k in states else -math.inf)

    sum_t = torch.tensor(sum_vals, dtype=torch.float64, device=device)
    ext_t = torch.tensor(ext_vals, dtype=torch.float64, device=device)
    if sum_vals:
        dist.all_reduce(sum_t, op=dist.ReduceOp.SUM, group=group)
    if ext_vals:
        dist.all_reduce(ext_t, op=dist.ReduceOp.MAX, group=group)
    sum_l, ext_l = sum_t.tolist(), ext_t.tolist()

    out: dict[str, float] = {}
    weight_of = dict(zip(means, sum_l[len(sums) :]))
    for k, total in zip(sums, sum_l[: len(sums)]):
        if union[k] == "sum":
            out[k] = total
        elif weight_of[k] > 0:
            out[k] = total / weight_of[k]
    for k, v in zip(extremes, ext_l):
        out[k] = v if union[k] == "max" else -v
    return {k: out[k] for k in keys if k in out}
