"""MetricsAccumulator and reduce_across_ranks against naive reductions over the raw records."""

import json
import math
import os
import random

import pytest
import torch
import torch.distributed as dist
from procs import free_port, spawn

from rlloom.observability.metrics import Max, Mean, MetricsAccumulator, Min, Sum, reduce_across_ranks

KINDS = {"loss/policy": Mean, "perf/tokens": Sum, "memory/peak_gib": Max, "reward/min": Min}


def random_records(rng: random.Random, num: int) -> list[dict]:
    records = []
    for _ in range(num):
        record = {}
        for key, kind in KINDS.items():
            if rng.random() < 0.7:  # not every record has every key
                value = rng.uniform(-5, 5)
                record[key] = kind(value, weight=rng.randint(0, 9)) if kind is Mean else kind(value)
        records.append(record)
    return records


def naive(records: list[dict]) -> dict[str, float]:
    out = {}
    for key, kind in KINDS.items():
        items = [r[key] for r in records if key in r]
        if not items:
            continue
        if kind is Mean:
            total_w = sum(m.weight for m in items)
            if total_w > 0:
                out[key] = sum(m.value * m.weight for m in items) / total_w
        elif kind is Sum:
            out[key] = sum(m.value for m in items)
        elif kind is Max:
            out[key] = max(m.value for m in items)
        else:
            out[key] = min(m.value for m in items)
    return out


def assert_close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key in want:
        assert math.isclose(got[key], want[key], rel_tol=1e-9, abs_tol=1e-9), key


@pytest.mark.parametrize("seed", range(5))
def test_accumulator_matches_naive_and_is_split_invariant(seed):
    rng = random.Random(seed)
    records = random_records(rng, 40)
    whole = MetricsAccumulator()
    whole.add_all(records)
    assert_close(whole.summary(), naive(records))

    # Aggregating per micro-batch chunk and merging gives the same numbers.
    merged = MetricsAccumulator()
    cut = sorted(rng.sample(range(1, 40), 3))
    for lo, hi in zip([0, *cut], [*cut, 40]):
        part = MetricsAccumulator()
        part.add_all(records[lo:hi])
        merged.merge(part)
    assert_close(merged.summary(), naive(records))


def test_mean_of_means_is_weighted():
    acc = MetricsAccumulator()
    acc.add({"loss/policy": Mean(1.0, weight=1)})
    acc.add({"loss/policy": Mean(4.0, weight=3)})
    assert acc.summary() == {"loss/policy": pytest.approx(3.25)}
    acc.add({"loss/kl": Mean(2.0, weight=0)})  # nothing behind it: left out
    assert "loss/kl" not in acc.summary()
    acc.reset()
    assert acc.summary() == {}


def test_tensor_values_are_accepted():
    acc = MetricsAccumulator()
    acc.add({"loss/policy": Mean(torch.tensor(2.0), weight=torch.tensor(4))})
    assert acc.summary() == {"loss/policy": 2.0}
    with pytest.raises(ValueError, match="scalar"):
        acc.add({"loss/policy": Mean(torch.ones(3))})


def test_user_errors_name_the_key():
    acc = MetricsAccumulator()
    acc.add({"perf/tokens": Sum(3)})
    with pytest.raises(ValueError, match="perf/tokens.*'sum'.*'max'"):
        acc.add({"perf/tokens": Max(3)})
    with pytest.raises(ValueError, match="component/quantity_unit"):
        acc.add({"tokens": Sum(1)})
    with pytest.raises(ValueError, match="carry their reduction"):
        acc.add({"perf/tok": 1.0})
    with pytest.raises(ValueError, match="weight"):
        acc.add({"loss/x": Mean(1.0, weight=-1)})


def test_reduce_without_process_group_is_summary():
    acc = MetricsAccumulator()
    acc.add({"perf/tokens": Sum(5), "memory/peak_gib": Max(1.5)})
    if dist.is_initialized():
        pytest.skip("an earlier test in this process initialised torch.distributed (GPU runs)")
    assert reduce_across_ranks(acc) == acc.summary()


def _rank_main(rank: int, world: int, port: int, records: list[list[dict]], out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        acc = MetricsAccumulator()
        acc.add_all(records[rank])
        result = reduce_across_ranks(acc)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def test_reduce_across_two_gloo_ranks_equals_one_accumulator(tmp_path):
    rng = random.Random(7)
    per_rank = [random_records(rng, 6), random_records(rng, 9)]
    per_rank[1].append({"rank1/only": Sum(2.0)})  # a key only one rank saw
    spawn(_rank_main, args=(2, free_port(), per_rank, str(tmp_path)), nprocs=2, join=True)
    want = naive(per_rank[0] + per_rank[1])
    want["rank1/only"] = 2.0
    for rank in (0, 1):
        assert_close(json.loads((tmp_path / f"rank{rank}.json").read_text()), want)
