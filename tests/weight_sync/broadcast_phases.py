"""The broadcast tests' phases, run in four processes spawned once per session (the `broadcast`
fixture in conftest.py spawns `worker`; each rank writes what it saw to `rank{r}.json`):

0. expert parallelism, on all four (`ep_phase.expert_parallel_sync`), then tensor parallelism
   (`tp_phase.tensor_parallel_sync`); then, on the first three:
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
"""

from __future__ import annotations

import inspect
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from rlloom.engines.rollout.native import NativeEngine, SamplingParams
from rlloom.weight_sync import outbox
from rlloom.weight_sync.base import WeightSyncError
from rlloom.weight_sync.broadcast import SyncGroupSpec, join_sync_group, send_weights
from rlloom.weight_sync.receive import receive_weights
from rlloom.weight_sync.reshard import RolloutLayout, chunk_box
from tests.weight_sync.ep_phase import expert_parallel_sync
from tests.weight_sync.sync_helpers import ShardSink, TrainSide, rollout_engine, rollout_weights, shard_dims
from tests.weight_sync.tp_phase import tensor_parallel_sync

NUM_PORTS = 10
"""Ports `worker` takes: 3 for phases 1-3, 3 for the expert-parallel phase, 4 for the tensor-parallel one."""
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
        outbox.post_broadcast = _flip_bucket_bytes(original := outbox.post_broadcast)
    check("checksum", _sync(group, side, rank))
    if rank == 1:
        outbox.post_broadcast = original
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


def greedy(engine) -> list:
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
    out["tp_engine"] = greedy(engine)
    dist.destroy_process_group()


def worker(rank: int, ports: tuple[int, ...], folder: str) -> None:
    torch.set_num_threads(1)
    expert_parallel_sync(rank, ports[3:6], Path(folder))
    tensor_parallel_sync(rank, ports[6:], Path(folder))
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
