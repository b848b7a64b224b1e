"""Broadcast weight sync between separate processes (gloo, CPU; `broadcast_phases` runs them): the
rollout equals the training weights after the 1st and the 10th sync (dense with tied embeddings,
Qwen3-MoE, DeepSeek-V3 MLA), and a rollout.tp=2 rank receives only its slice, after which the
tensor-parallel engine generates as a tp=1 engine holding the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.weight_sync.broadcast_phases import KINDS, TP_ENGINE, greedy
from tests.weight_sync.sync_helpers import rollout_engine

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("kind", KINDS)
def test_rollout_equals_training_after_1st_and_10th_sync(broadcast_results, kind):
    receiver = broadcast_results[2]
    assert receiver[f"{kind}_1"] and receiver[f"{kind}_10"]


@pytest.mark.skipif(
    not TP_ENGINE, reason="this build's rollout engine has no tensor parallelism (rollout.tp)"
)
def test_tensor_parallel_engine_after_sync_generates_as_tp1(broadcast_results):
    reference = rollout_engine("dense")
    folder = Path(broadcast_results[0]["folder"])
    reference.update_weights(torch.load(folder / "tp_sent.pt").items(), version=2)
    for got, want in zip(broadcast_results[1]["tp_engine"], greedy(reference), strict=True):
        assert got[0] == want[0]
        assert max(abs(a - b) for a, b in zip(got[1], want[1])) < 1e-5


def test_tensor_parallel_rank_receives_only_its_slice(broadcast_results):
    for rank in (1, 2):
        assert broadcast_results[rank]["tp_equal"]
        # the replicated norms travel to both ranks; everything else is halved
        assert broadcast_results[rank]["tp_bytes"] < 0.6 * broadcast_results[rank]["full_bytes"]
