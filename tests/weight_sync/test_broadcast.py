"""Broadcast weight sync between separate processes (gloo, CPU), four processes spawned once:

0. expert parallelism (all four, `sync_helpers.expert_parallel_sync`): a Qwen3-MoE trained on 2
   ranks with parallel.ep=2, both sending owner-only, into one replica of rollout.tp=2, then two
   replicas of rollout.tp=1: each rollout rank's weights equal its slice of the all-gathered
   export, each sender sends only its own experts, and no EP all-gather runs during the syncs;
   then, on the first three:
1. two training ranks (replicas: the plan splits the sending between them) -> one native rollout
   engine, for a dense model with tied embeddings, Qwen3-MoE and DeepSeek-V3 (MLA): after the 1st
   and the 10th sync (the trainer steps at a large learning rate in between) every rollout tensor
   equals the training weights;
2. failures on the same group: a byte flipped on the wire (checksum mismatch), a tensor the training
   engine does not yield: each raises WeightSyncError on both sides, the rollout keeps its weights
   and version, and the next sync succeeds; then a sender that stalls past sync timeout_s;
3. one training rank -> one replica of rollout.tp=2: each TP rank receives only its slice; where
   the build has the tensor-parallel rollout engine, a second sync into it, whose greedy tokens
   and logprobs then match a tp=1 engine holding the weights sent.
Each rank writes what it saw to a JSON file; the tests below read them.
"""

from __future__ import annotations

import inspect
import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from procs import free_port, spawn

from rlloom.engines.rollout.native import NativeEngine, SamplingParams
from rlloom.weight_sync import broadcast
from rlloom.weight_sync.base import WeightSyncError
from rlloom.weight_sync.broadcast import SyncGroupSpec, join_sync_group, send_weights
from rlloom.weight_sync.receive import receive_weights
from rlloom.weight_sync.reshard import RolloutLayout, chunk_box, full_box
from tests.weight_sync.sync_helpers import (
    ShardSink,
    TrainSide,
    expert_of,
    expert_parallel_sync,
    rollout_engine,
    rollout_weights,
    shard_dims,
)

pytestmark = pytest.mark.slow

KINDS = ("dense", "moe", "mla")
TP_ENGINE = "tp_group" in inspect.signature(NativeEngine.__init__).parameters
PROMPTS = [[5, 9, 12, 30, 7], [40, 41, 3]]
BUCKET = 8 << 10  # small buckets: several per sync, tensors split across them


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)


def _sync(group, side, rank: int, *, checksum: bool = True):
    """One sync from this rank's side; returns (ok, error message)."""
    try:
        if group.is_sender:
            send_weights(group, side, bucket_bytes=BUCKET, checksum=checksum)
        else:
            receive_weights(group, side, checksum=checksum)
        return True, ""
    except WeightSyncError as exc:
        return False, str(exc)


def _flip_bucket_bytes(original):
    def corrupt(link, tensor, root):
        if tensor.is_floating_point() and link.local_rank == root == 0:  # a weight bucket this rank sends
            tensor = tensor.clone()
            tensor.view(torch.uint8)[7] ^= 0x10
        return original(link, tensor, root)

    return corrupt


def _parity(group, rank: int, out: dict) -> None:
    for kind in KINDS:
        # the receiver replays the training (same seed) to know the weights it must end up with
        train = TrainSide(kind)
        engine = None if group.is_sender else rollout_engine(kind)
        for sync in range(1, 11):
            train.step()
            ok, err = _sync(group, train if group.is_sender else engine, rank)
            assert ok, err
            if engine is not None and sync in (1, 10):
                out[f"{kind}_{sync}"] = (
                    _equal(rollout_weights(engine), train.weights()) and engine.policy_version == sync
                )


def _failures(group, rank: int, out: dict) -> None:
    side = TrainSide("dense") if group.is_sender else rollout_engine("dense")
    if group.is_sender:
        side.step()
    assert _sync(group, side, rank)[0]
    before = None if group.is_sender else rollout_weights(side)

    def check(name: str, ok_err) -> None:
        out[f"{name}_error"] = ok_err[1]
        if not group.is_sender:
            out[f"{name}_kept"] = _equal(rollout_weights(side), before) and side.policy_version == 1

    if group.is_sender:
        side.step()
    if rank == 1:
        broadcast.post_broadcast = _flip_bucket_bytes(original := broadcast.post_broadcast)
    check("checksum", _sync(group, side, rank))
    if rank == 1:
        broadcast.post_broadcast = original
    if group.is_sender:
        side.skip = {"model.layers.1.mlp.down_proj.weight"}
    check("missing", _sync(group, side, rank))
    if group.is_sender:
        side.skip = set()
    out["recovered"] = _sync(group, side, rank)[0] and (group.is_sender or side.policy_version == 2)


def _timeout(spec: SyncGroupSpec, rank: int, out: dict) -> None:
    group = join_sync_group(spec, rank, torch.device("cpu"))
    side = TrainSide("dense") if group.is_sender else rollout_engine("dense")
    if group.is_sender:
        original = side.named_weights

        def stalled(**kwargs):
            time.sleep(spec.timeout_s + 3)
            yield from original(**kwargs)
            out["timeout_drained"] = True  # the other training ranks' gathers would need every bucket

        side.named_weights = stalled
    start = time.monotonic()
    ok, err = _sync(group, side, rank)
    if group.is_sender:
        out["timeout_sender_error"] = err
    else:
        out["timeout_error"] = err
        out["timeout_s"] = time.monotonic() - start
        out["timeout_kept"] = side.policy_version == 0 and all(
            bool((t == 0).all()) for t in rollout_weights(side).values()
        )
    group.close()


def _tensor_parallel(spec: SyncGroupSpec, rank: int, out: dict) -> None:
    group = join_sync_group(spec, rank, torch.device("cpu"))
    train = TrainSide("dense")
    train.step()
    full = train.weights()
    dims = shard_dims(list(full))
    layout = RolloutLayout.split({n: tuple(t.shape) for n, t in full.items()}, 2, dims)
    if group.is_sender:
        report = send_weights(group, train, bucket_bytes=BUCKET, checksum=True)
    else:
        sink = ShardSink()
        mine = layout.ranks[group.tp_rank]
        report = receive_weights(group, sink, checksum=True, layout=mine, dtype=torch.float32)
        r = group.tp_rank
        expected = {}
        for name, tensor in full.items():
            dim = dims.get(name)
            box = chunk_box(tuple(tensor.shape), dim, r, 2) if dim is not None else None
            expected[name] = tensor if box is None else tensor[tuple(slice(a, b) for a, b in box)]
        out["tp_equal"] = _equal(sink.tensors, expected)
        out["tp_bytes"] = report.num_bytes
        out["full_bytes"] = sum(t.numel() * t.element_size() for t in full.values())
    if TP_ENGINE:  # the real tensor-parallel rollout engine, in builds that have it (rollout.tp)
        _tensor_parallel_engine(group, train, out)
    group.close()


def _greedy(engine) -> list:
    done = engine.generate(PROMPTS, [SamplingParams(n=1, temperature=0.0, max_new_tokens=6)] * len(PROMPTS))
    return [[c.token_ids, c.logprobs] for c in done]


def _tensor_parallel_engine(group, train: TrainSide, out: dict) -> None:
    """A second sync into a rollout.tp=2 native engine (default layout: its own weight_shard_slices)."""
    train.step()
    if group.is_sender:
        send_weights(group, train, bucket_bytes=BUCKET, checksum=True)
        torch.save(train.weights(), out["dir"] / "tp_sent.pt")
        return
    rendezvous = f"file://{out['dir'] / 'tp_world'}"
    dist.init_process_group("gloo", init_method=rendezvous, rank=group.tp_rank, world_size=2)
    engine = rollout_engine("dense", tp_group=dist.group.WORLD)
    receive_weights(group, engine, checksum=True)
    out["tp_engine"] = _greedy(engine)
    dist.destroy_process_group()


def _worker(rank: int, ports: tuple[int, ...], folder: str) -> None:
    torch.set_num_threads(1)
    expert_parallel_sync(rank, ports[3:], Path(folder))
    if rank == 3:  # the second rollout rank of the expert-parallel phase only
        return
    out: dict = {"dir": Path(folder)}
    spec = SyncGroupSpec(host="127.0.0.1", port=ports[0], num_senders=2, num_receivers=1, timeout_s=60)
    group = join_sync_group(spec, rank, torch.device("cpu"))
    _parity(group, rank, out)
    _failures(group, rank, out)
    group.close()
    tp_spec = SyncGroupSpec(host="127.0.0.1", port=ports[1], num_senders=1, num_receivers=2, rollout_tp=2)
    _tensor_parallel(tp_spec, rank, out)
    timeout_spec = SyncGroupSpec(host="127.0.0.1", port=ports[2], num_senders=2, num_receivers=1, timeout_s=4)
    _timeout(timeout_spec, rank, out)
    out["folder"] = str(out.pop("dir"))
    (Path(folder) / f"rank{rank}.json").write_text(json.dumps(out))


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    folder = tmp_path_factory.mktemp("broadcast")
    ports = tuple(free_port() for _ in range(5))
    spawn(_worker, args=(ports, str(folder)), nprocs=4, join=True)
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(3)]


@pytest.mark.parametrize("kind", KINDS)
def test_rollout_equals_training_after_1st_and_10th_sync(results, kind):
    receiver = results[2]
    assert receiver[f"{kind}_1"] and receiver[f"{kind}_10"]


def test_checksum_mismatch_keeps_previous_version(results):
    assert "checksum mismatch" in results[2]["checksum_error"]
    assert "keeps its previous weights" in results[2]["checksum_error"]
    assert results[2]["checksum_kept"]


def test_missing_tensor_keeps_previous_version_and_says_so_on_both_sides(results):
    for rank in (0, 1, 2):
        assert "model.layers.1.mlp.down_proj.weight" in results[rank]["missing_error"], results[rank]
    assert results[2]["missing_kept"]
    assert all(r["recovered"] for r in results)


def test_timeout_keeps_previous_version(results):
    receiver = results[2]
    assert (
        "timed out" in receiver["timeout_error"] and "keeps its previous weights" in receiver["timeout_error"]
    )
    assert receiver["timeout_s"] < 10 and receiver["timeout_kept"]
    for sender in results[:2]:  # the senders fail too, after going through all their weights
        assert "failed" in sender["timeout_sender_error"] and sender["timeout_drained"]


@pytest.mark.skipif(
    not TP_ENGINE, reason="this build's rollout engine has no tensor parallelism (rollout.tp)"
)
def test_tensor_parallel_engine_after_sync_generates_as_tp1(results):
    reference = rollout_engine("dense")
    folder = Path(results[0]["folder"])
    reference.update_weights(torch.load(folder / "tp_sent.pt").items(), version=2)
    for got, want in zip(results[1]["tp_engine"], _greedy(reference), strict=True):
        assert got[0] == want[0]
        assert max(abs(a - b) for a, b in zip(got[1], want[1])) < 1e-5


def test_tensor_parallel_rank_receives_only_its_slice(results):
    for rank in (1, 2):
        assert results[rank]["tp_equal"]
        # the replicated norms travel to both ranks; everything else is halved
        assert results[rank]["tp_bytes"] < 0.6 * results[rank]["full_bytes"]


@pytest.fixture(scope="module")
def ep(results) -> dict:
    """The expert-parallel phase: what each rank wrote."""
    folder = Path(results[0]["folder"])
    return {
        "senders": [json.loads((folder / f"ep_rank{r}.json").read_text()) for r in (0, 1)],
        "full": torch.load(folder / "ep_full.pt"),
        "received": {k: torch.load(folder / f"ep_{k}.pt") for k in ("tp2_2", "tp2_3", "tp1_2", "tp1_3")},
    }


def test_ep2_training_syncs_owner_only_to_rollout_tp1_and_tp2(ep):
    full = ep["full"]  # the whole model: the export that all-gathers the experts
    for key, got in ep["received"].items():  # checksums were compared on receipt too
        assert got["version"] == 1 and got["boxes"].keys() == full.keys(), key
        for name, box in got["boxes"].items():
            expected = full[name][tuple(slice(a, b) for a, b in box)]
            assert torch.equal(got["loaded"][name], expected), (key, name)
        split = [
            n for n, b in got["boxes"].items() if expert_of(n) is not None and b != full_box(full[n].shape)
        ]
        assert bool(split) == key.startswith("tp2")  # a tp=2 rank holds half of each expert's width


def test_each_ep_sender_owns_and_sends_only_its_experts_without_an_ep_all_gather(ep):
    for rank, sender in enumerate(ep["senders"]):
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
    full_bytes = sum(t.numel() * t.element_size() for t in ep["full"].values())
    assert sum(s["tp1"]["bytes"] for s in ep["senders"]) == full_bytes
    assert all(s["tp1"]["bytes"] < 0.7 * full_bytes for s in ep["senders"])
