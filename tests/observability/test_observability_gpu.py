"""On CUDA: timers synchronize, memory reads the allocator, and the NCCL reduction of metrics."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from procs import free_port

from rlloom.observability.memory import memory_metrics, peak_memory_gib, reset_peak_memory
from rlloom.observability.metrics import Max, Mean, MetricsAccumulator, Min, Sum, reduce_across_ranks
from rlloom.observability.timers import StageTimer

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
def test_timer_waits_for_kernels_and_memory_reads_allocator():
    x = torch.randn(4096, 4096, device="cuda")
    reset_peak_memory("cuda")
    timer = StageTimer()  # CUDA is initialised, so it synchronizes
    with timer("matmul"):
        for _ in range(20):
            y = x @ x
    # 20 products of 4096^3 take well over a millisecond even on an H200 in fp32.
    assert timer.seconds()["time/matmul_s"] > 1e-3
    assert peak_memory_gib("cuda") >= 2 * 4096 * 4096 * 4 / 2**30
    keys = set(memory_metrics("cuda"))
    assert keys == {"memory/peak_rss_gib", "memory/peak_allocated_gib", "memory/peak_reserved_gib"}
    del y


def _rank_main(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=torch.device("cuda", rank))
    try:
        acc = MetricsAccumulator()
        acc.add(
            {"loss/policy": Mean(float(rank + 1), weight=rank + 1), "perf/tokens": Sum(10.0 * (rank + 1))}
        )
        acc.add({"memory/peak_gib": Max(float(rank)), "reward/min": Min(-float(rank))})
        if rank == 1:
            acc.add({"rank1/only": Sum(2.0)})
        results[rank] = reduce_across_ranks(acc)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_reduce_across_two_nccl_ranks():
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank_main, args=(free_port(), results), nprocs=2, join=True)
        got = dict(results)
    # loss: (1*1 + 2*2) / (1 + 2); tokens 10 + 20; max of 0,1; min of 0,-1.
    want = {
        "loss/policy": 5 / 3,
        "perf/tokens": 30.0,
        "memory/peak_gib": 1.0,
        "reward/min": -1.0,
        "rank1/only": 2.0,
    }
    for rank in (0, 1):
        assert got[rank].keys() == want.keys()
        for key, value in want.items():
            assert got[rank][key] == pytest.approx(value)
