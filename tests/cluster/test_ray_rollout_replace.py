"""A replaced rollout replica runs the batches the lost one ran (stand-in actors, no Ray start): each
slot is a real `EngineStream` on the tiny model, and every engine step's batch (prefill or decode,
and which samples are in it) is recorded. With batch-dependent GPU kernels a token's logits depend on
the batch it runs in, so the replacement must admit every request the lost engine held together, the
ones already delivered in full too, or its step differs from the uninterrupted one on a GPU (the CPU's
kernels hide it: there the samples agree anyway)."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("ray", reason="needs the ray extra: pip install 'rlloom[ray]'")

import ray  # noqa: E402

from rlloom.cluster.ray_rollout import RayRolloutGroup  # noqa: E402
from rlloom.cluster.ray_slots import SlotFailure  # noqa: E402
from rlloom.engines.rollout import SamplingParams  # noqa: E402
from rlloom.engines.rollout.native import NativeEngine  # noqa: E402
from rlloom.workers.flights import StreamRequest  # noqa: E402
from rlloom.workers.stream import EngineStream  # noqa: E402


def recorded_stream(path, schedule: list) -> EngineStream:
    """A stream on a fresh tiny engine whose every step appends (prefill?, its rows) to `schedule`."""
    engine = NativeEngine.from_pretrained(path, max_model_len=64, num_blocks=64, block_size=4, max_num_seqs=4)
    step = engine.step

    def recorded():
        out = step()
        batch = engine.last_batch
        if batch is not None:
            schedule.append((batch.is_prefill, [(s.request_id, s.sample_index) for s in batch.rows]))
        return out

    engine.step = recorded
    return EngineStream(engine, timeout_s=60)


class StreamActors:
    """One rollout slot whose calls run at once on its stream; `dead` makes them fail as a lost actor's."""

    def __init__(self, path) -> None:
        self.path = path
        self.schedules: list[list] = []
        self.start()

    def start(self) -> None:
        """A fresh actor (the first, or a replacement): a new engine and its own schedule."""
        self.dead = False
        self.schedules.append([])
        self.stream = recorded_stream(self.path, self.schedules[-1])

    def call(self, slots, worker, method, *args):
        assert worker == "on_rollout"
        if self.dead:
            return [SlotFailure("rollout rank 0 died", [0])]
        name = {"stream_add": "add", "stream_poll": "poll", "stream_abort": "abort"}[method]
        return [getattr(self.stream, name)(*args)]

    def wait_each(self, refs, stage, slots, extra_s=0.0):
        return refs


def requests() -> list[StreamRequest]:
    """Three prompts of 2 samples each: the engine (4 sequences at most) runs two at a time."""
    return [
        StreamRequest(
            request_id=f"r{i}",
            prompt_ids=[3 + i, 7, 11 + 2 * i],
            sampling=SamplingParams(n=2, temperature=1.0, max_new_tokens=4 + 2 * i, seed=i, ignore_eos=True),
            prompt_index=i,
        )
        for i in range(3)
    ]


def poll_until(group: RayRolloutGroup, done) -> list:
    got, deadline = [], time.monotonic() + 60
    while not done(got):
        assert time.monotonic() < deadline, got
        got += group.stream_poll(0.05)
    return got


def test_a_replaced_replica_admits_every_request_its_engine_held_and_meets_the_same_batches(
    tiny_checkpoint, monkeypatch
):
    monkeypatch.setattr(ray, "put", lambda x: x)
    uninterrupted = StreamActors(tiny_checkpoint)
    group = RayRolloutGroup(uninterrupted, [[0]], max_num_seqs=4)
    group.stream_add(0, requests())
    assert len(poll_until(group, lambda got: len(got) == 6)) == 6
    group.stream_abort()

    actors = StreamActors(tiny_checkpoint)
    group = RayRolloutGroup(actors, [[0]], max_num_seqs=4, max_restarts=1, recover=lambda r: actors.start())
    group.stream_add(0, requests())
    first = poll_until(group, lambda got: any(x.completion.request_id == "r0" for x in got))
    first += poll_until(group, lambda got: sum(x.completion.request_id == "r0" for x in first + got) == 2)
    actors.stream.abort()  # the actor dies with r0 delivered in full, the others in flight
    actors.dead = True
    group.stream_poll(0.05)  # the failure is seen: a fresh actor takes its place
    rest = poll_until(group, lambda got: len(first) + len(got) == 6)
    group.stream_abort()

    assert group.restarts == 1
    delivered = sorted((x.completion.request_id, x.completion.sample_index) for x in first + rest)
    assert delivered == [(f"r{i}", j) for i in range(3) for j in range(2)]  # each sample once
    replacement = actors.schedules[-1]
    assert replacement == uninterrupted.schedules[0], "the replacement ran other batches"
