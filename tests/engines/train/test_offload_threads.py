"""Optimizer offload gives the CPU AdamW this rank's share of the host's cores: launchers (torchrun,
Ray actors) leave torch one thread, which made a 2 x H200 step with half of the optimizer on CPU
take 67 s."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "parallel"))
from parallel_helpers import run_gloo  # noqa: E402

from rlloom.config import TrainEngineConfig  # noqa: E402
from rlloom.engines.train.native.optimizer import (  # noqa: E402
    EngineOptimizer,
    offload_threads,
    ranks_on_this_host,
)

CORES = len(os.sched_getaffinity(0))


def test_offload_threads_share_the_cores():
    assert offload_threads(32, 2) == 16
    assert offload_threads(16, 1) == 16
    assert offload_threads(2, 4) == 1  # never 0
    assert offload_threads(7, 0) == 7


def _optimizer(offload: bool) -> EngineOptimizer:
    model = nn.Linear(8, 8)
    cfg = TrainEngineConfig(optimizer_offload=offload, optimizer_offload_fraction=0.5)
    return EngineOptimizer(list(model.named_parameters()), cfg)


@pytest.mark.skipif(CORES < 2, reason="needs 2 cores to see the thread count rise")
def test_offload_raises_torch_threads_from_one():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        _optimizer(offload=False)
        assert torch.get_num_threads() == 1  # no CPU half: left alone
        _optimizer(offload=True)
        assert torch.get_num_threads() == CORES
    finally:
        torch.set_num_threads(before)


def _two_ranks(rank: int) -> None:
    assert ranks_on_this_host() == 2
    _optimizer(offload=True)  # the hostname gather inside runs on every rank
    assert torch.get_num_threads() == max(1, offload_threads(CORES, 2))


def test_two_ranks_on_one_host_split_the_cores():
    assert ranks_on_this_host() == 1  # no process group
    run_gloo(_two_ranks, 2)
