"""Broadcast weight sync failures between separate processes (gloo, CPU; `broadcast_phases` runs
them): a checksum mismatch, a tensor the training engine does not yield and a sender that stalls
past sync.timeout_s each fail the sync on every side, the rollout keeps its previous weights and
version, and the next sync on the same group succeeds."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_checksum_mismatch_keeps_previous_version(broadcast_results):
    assert "checksum mismatch" in broadcast_results[2]["checksum_error"]
    assert "keeps its previous weights" in broadcast_results[2]["checksum_error"]
    assert broadcast_results[2]["checksum_kept"]


def test_missing_tensor_keeps_previous_version_and_says_so_on_both_sides(broadcast_results):
    for rank in (0, 1, 2):
        result = broadcast_results[rank]
        assert "model.layers.1.mlp.down_proj.weight" in result["missing_error"], result
    assert broadcast_results[2]["missing_kept"]
    assert all(r["recovered"] for r in broadcast_results)


def test_timeout_keeps_previous_version(broadcast_results):
    receiver = broadcast_results[2]
    assert (
        "timed out" in receiver["timeout_error"] and "keeps its previous weights" in receiver["timeout_error"]
    )
    assert receiver["timeout_s"] < 10 and receiver["timeout_kept"]
    for sender in broadcast_results[:2]:  # the senders fail too, after going through all their weights
        assert "failed" in sender["timeout_sender_error"] and sender["timeout_drained"]
