"""Broadcast weight sync from a model trained with parallel.tp=2 (gloo, CPU; `tp_phase` runs it): the
dense Qwen3 (tied embeddings) and the Qwen3-MoE send owner-only into one replica of rollout.tp=2,
then into two of rollout.tp=1. Each rollout rank's weights equal its slice of the full training
weights; each sender yields and sends only its own TP shard of the tensor-parallel tensors, and no
all-gather runs (none over TP: the FSDP degree is 1 here) during those syncs. Under FSDP 2 x tp=2
(4 ranks), and under pp=2 x tp=2, each rank's owner-only export is the box of the full tensors its
layout gives it."""

from __future__ import annotations

import re

import pytest
import torch

from tests.weight_sync.tp_phase import KINDS

pytestmark = pytest.mark.slow

TP_SHARDED = {  # HF name pattern -> TP shard dim: column-, row- and vocabulary-parallel
    r"q_proj|k_proj|v_proj|gate_proj|up_proj": 0,
    r"o_proj|down_proj": 1,
    r"embed_tokens|lm_head": 0,
}


def tp_dim(name: str) -> int | None:
    """The dim the training TP plan shards `name` along (None: replicated over TP, e.g. experts)."""
    if ".experts." in name:
        return None
    return next((dim for pattern, dim in TP_SHARDED.items() if re.search(pattern, name)), None)


def piece(key: str) -> tuple[str, list[tuple[int, int]]]:
    """`name[0:4,0:2]` -> (name, [(0, 4), (0, 2)])."""
    name, _, box = key[:-1].partition("[")
    return name, [tuple(int(x) for x in r.split(":")) for r in box.split(",")]


@pytest.mark.parametrize("kind", KINDS)
def test_tp2_training_syncs_owner_only_to_rollout_tp1_and_tp2(tp_results, kind):
    full = tp_results[kind]["exports"][0]["full"]  # the whole model: the export that gathers TP shards
    for key, got in tp_results[kind]["received"].items():  # checksums were compared on receipt too
        assert got["version"] == 1 and got["boxes"].keys() == full.keys(), key
        for name, box in got["boxes"].items():
            expected = full[name][tuple(slice(a, b) for a, b in box)]
            assert torch.equal(got["loaded"][name], expected), (key, name)


@pytest.mark.parametrize("kind", KINDS)
def test_each_tp_sender_yields_and_sends_only_its_tp_shards_without_an_all_gather(tp_results, kind):
    results = tp_results[kind]
    full = results["exports"][0]["full"]
    sharded = {n: tp_dim(n) for n in full if tp_dim(n) is not None}
    assert "lm_head.weight" in sharded if kind == "moe" else "lm_head.weight" not in full  # tied
    for rank, sender in enumerate(results["senders"]):
        t = sender["tp_rank"]
        assert t == rank and sender["tp_shards"] == {n: [d, 2] for n, d in sharded.items()}
        owned = results["exports"][rank]["owned"]
        assert owned.keys() == full.keys()
        for name, tensor in owned.items():  # the owner-only export: its TP shard, the rest whole
            dim = sharded.get(name)
            assert torch.equal(tensor, full[name] if dim is None else full[name].chunk(2, dim)[t]), name
        assert sender["owned_all_gathers"] == 0 and sender["full_all_gathers"] > 0  # the count works
        for sync in ("tp2", "tp1"):
            assert sender[sync]["all_gathers"] == 0, (rank, sync)
            for key in sender[sync]["pieces"]:
                name, box = piece(key)
                dim = sharded.get(name)
                if dim is not None:  # only from its own shard; to rollout.tp=2 its peer's rank alone
                    half = full[name].shape[dim] // 2
                    assert t * half <= box[dim][0] < box[dim][1] <= (t + 1) * half, (rank, sync, key)
        assert {n for n, d in sharded.items() if d == 0} <= {piece(k)[0] for k in sender["tp1"]["pieces"]}
    # each element reaches each rollout tp rank holding it once (the two tp=1 replicas take each bucket
    # in one broadcast: one model), and the two senders share the work
    for sync, ranks in (("tp2", (2, 3)), ("tp1", (2,))):
        boxes = [b for r in ranks for b in results["received"][f"{sync}_{r}"]["boxes"].values()]
        wanted = 4 * sum(torch.Size([b - a for a, b in box]).numel() for box in boxes)  # fp32
        sent = [s[sync]["bytes"] for s in results["senders"]]
        assert sum(sent) == wanted and max(sent) < 0.7 * wanted, (sync, sent)


@pytest.mark.parametrize("layout", ["fsdp_tp", "pp_tp"])
def test_under_fsdp_or_pp_and_tp_each_rank_yields_the_box_its_layout_gives_it(tp_results, layout):
    ranks = tp_results[layout]
    assert [r["tp_rank"] for r in ranks] == [0, 1, 0, 1]
    for r in ranks:
        assert r["wrong"] == [] and r["names"] == ranks[0]["names"]
        expected = sorted(n for n in r["names"] if tp_dim(n) is not None)
        assert r["split"] == expected and ("lm_head.weight" in expected) == (layout == "fsdp_tp")
