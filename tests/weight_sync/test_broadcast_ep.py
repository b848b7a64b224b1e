"""Broadcast weight sync from a Qwen3-MoE trained with parallel.ep=2 (gloo, CPU; `ep_phase` runs
it): both training ranks send owner-only into one replica of rollout.tp=2, then into two of
rollout.tp=1: each rollout rank's weights equal its slice of the all-gathered export, each sender
sends only its own experts, and no EP all-gather runs during those syncs. Sent without a training
layout, every rank exports full tensors (experts all-gathered over EP) and the rollout gets the same
weights."""

from __future__ import annotations

import pytest
import torch

from rlloom.weight_sync.reshard import full_box
from tests.weight_sync.sync_helpers import expert_of

pytestmark = pytest.mark.slow


def test_ep2_training_syncs_owner_only_to_rollout_tp1_and_tp2(ep_results):
    full = ep_results["full"]  # the whole model: the export that all-gathers the experts
    for key, got in ep_results["received"].items():  # checksums were compared on receipt too
        assert got["version"] == 1 and got["boxes"].keys() == full.keys(), key
        for name, box in got["boxes"].items():
            expected = full[name][tuple(slice(a, b) for a, b in box)]
            assert torch.equal(got["loaded"][name], expected), (key, name)
        split = [
            n for n, b in got["boxes"].items() if expert_of(n) is not None and b != full_box(full[n].shape)
        ]
        assert bool(split) == key.startswith("tp2")  # a tp=2 rank holds half of each expert's width


def test_each_ep_sender_owns_and_sends_only_its_experts_without_an_ep_all_gather(ep_results):
    for rank, sender in enumerate(ep_results["senders"]):
        mine = {2 * rank, 2 * rank + 1}  # 4 experts over ep=2
        assert sender["owned_experts"] == sorted(mine)  # the owner-only export yields only these
        for name, owners in sender["owners"].items():  # the plan's training layout
            assert owners == (
                [0] if expert_of(name) in (0, 1) else [1] if expert_of(name) is not None else [0, 1]
            )
        for sync in ("tp2", "tp1"):
            sent = {expert_of(p) for p in sender[sync]["pieces"]} - {None}
            assert sent == mine, (rank, sync, sent)
            assert sender[sync]["all_gathers"] == 0  # no EP all-gather during the sync
            assert any(expert_of(p) is None for p in sender[sync]["pieces"])  # a share of the dense tensors
        assert sender["full_all_gathers"] > 0  # the gathering export does all-gather (the count works)
    # the two tp=1 replicas take each bucket in one broadcast: the senders' bytes add up to one model
    full_bytes = sum(t.numel() * t.element_size() for t in ep_results["full"].values())
    assert sum(s["tp1"]["bytes"] for s in ep_results["senders"]) == full_bytes
    assert all(s["tp1"]["bytes"] < 0.7 * full_bytes for s in ep_results["senders"])


def test_ep2_training_without_a_layout_sends_full_tensors(ep_results):
    full = ep_results["full"]
    for key, got in ep_results["gathered"].items():
        assert got["version"] == 1 and got["boxes"].keys() == full.keys(), key
        assert all(torch.equal(got["loaded"][n], t) for n, t in full.items()), key
    for sender in ep_results["senders"]:  # each exported every expert (all-gathered over EP) ...
        assert sender["gathered"]["all_gathers"] > 0
    # ... and the plan split the sending between both: their bytes add up to one model
    full_bytes = sum(t.numel() * t.element_size() for t in full.values())
    assert sum(s["gathered"]["bytes"] for s in ep_results["senders"]) == full_bytes
    assert all(0 < s["gathered"]["bytes"] < 0.7 * full_bytes for s in ep_results["senders"])
