"""A rollout replica replaced under streamed requests (`RayRolloutGroup`, with stand-in actors that
host real `EngineStream`s on the tiny checkpoint; no Ray start): a streamed sample whose tokens were
passed on continues from them on the replacement, whatever the replacement would sample afresh (here
it draws other noise for the same seed, as a GPU replay in another batch may), so the sample trained
is the one its client read; the others are made again."""

from __future__ import annotations

import dataclasses
import time

import pytest

pytest.importorskip("ray", reason="needs the ray extra: pip install 'rlloom[ray]'")

import ray  # noqa: E402

import rlloom.models as models  # noqa: E402
from rlloom.cluster.ray_rollout import RayRolloutGroup  # noqa: E402
from rlloom.cluster.ray_slots import SlotFailure  # noqa: E402
from rlloom.engines.rollout.native import NativeEngine, SamplingParams  # noqa: E402
from rlloom.models.adapter import hf_named_tensors  # noqa: E402
from rlloom.workers.flights import StreamPartial, StreamRequest, StreamResult  # noqa: E402
from rlloom.workers.stream import EngineStream  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9], [11, 3]]
PARAMS = SamplingParams(n=2, temperature=1.0, max_new_tokens=14, seed=3, ignore_eos=True)


class Worker:
    """What a rollout actor's `on_rollout` reaches: the stream calls on one engine."""

    def __init__(self, engine: NativeEngine) -> None:
        self.stream = EngineStream(engine)

    def stream_add(self, requests):
        self.stream.add(requests)

    def stream_poll(self, timeout_s):
        return self.stream.poll(timeout_s)


class Actors:
    """Slot 0's worker; a dead slot's calls come back as its `SlotFailure`."""

    def __init__(self, worker: Worker) -> None:
        self.worker, self.dead = worker, False

    def call(self, slots, method, name, *args):
        assert method == "on_rollout" and slots == [0]
        if self.dead:
            return [SlotFailure("rollout rank 0 died", [0])]
        return [getattr(self.worker, name)(*args)]

    def wait_each(self, refs, stage, slots, extra_s=0.0):
        return refs


def _engine(path, *, step_s: float = 0.0) -> NativeEngine:
    engine = NativeEngine(
        models.from_pretrained(path, fused_projections=True), max_model_len=64, num_blocks=64, block_size=4
    )
    step = engine.step

    def slowed():
        time.sleep(step_s)
        return step()

    engine.step = slowed
    return engine


def _reseeded(engine: NativeEngine) -> NativeEngine:
    """`engine` drawing other noise for every seed (a replay that samples other tokens), at version 1."""
    add, resume = engine.add_request, engine.resume_request

    def other(sampling: SamplingParams) -> SamplingParams:
        return dataclasses.replace(sampling, seed=sampling.seed + 1)

    engine.add_request = lambda prompt, sampling, **kw: add(prompt, other(sampling), **kw)
    engine.resume_request = lambda prompt, sampling, **kw: resume(prompt, other(sampling), **kw)
    engine.update_weights(list(hf_named_tensors(engine.model)), version=1)  # the current weights
    return engine


def test_a_replaced_replica_continues_streamed_samples_from_the_tokens_passed_on(
    tiny_checkpoint, monkeypatch
):
    monkeypatch.setattr(ray, "put", lambda x: x)
    straight = {
        (c.prompt_index, c.sample_index): c for c in _engine(tiny_checkpoint).generate(PROMPTS, PARAMS)
    }
    actors = Actors(Worker(_engine(tiny_checkpoint, step_s=0.02)))

    def recover(replica: int) -> None:
        actors.worker, actors.dead = Worker(_reseeded(_engine(tiny_checkpoint))), False

    group = RayRolloutGroup(actors, [[0]], max_num_seqs=4, max_restarts=1, recover=recover)
    group.stream_add(
        0,
        [
            StreamRequest(request_id=str(i), prompt_ids=p, sampling=PARAMS, prompt_index=i, progress=i == 0)
            for i, p in enumerate(PROMPTS)
        ],
    )
    read: dict[int, StreamPartial] = {}  # what the streaming client was passed, newest per sample
    deadline = time.monotonic() + 60
    while not (len(read) == 2 and all(len(p.partial.token_ids) >= 4 for p in read.values())):
        assert time.monotonic() < deadline, "no streamed tokens"
        for x in group.stream_poll(0.5):
            assert isinstance(x, StreamPartial), "the request finished before the kill"
            read[x.partial.sample_index] = x
    actors.worker.stream.drop_all()  # the actor dies: nothing more of it comes out
    actors.dead = True

    got: dict[tuple[int, int], StreamResult] = {}
    deadline = time.monotonic() + 60
    while len(got) < 4:
        assert time.monotonic() < deadline, f"only {sorted(got)} delivered"
        for x in group.stream_poll(0.5):
            if isinstance(x, StreamResult):
                key = (x.completion.prompt_index, x.completion.sample_index)
                assert key not in got, f"{key} delivered twice"
                got[key] = x
    assert group.restarts == 1 and not any(group.held) and not group.passed
    for j, p in read.items():
        c, k = got[0, j].completion, len(p.partial.token_ids)
        # the tokens read are the sample's first ones, their logprobs and version 0 kept; the rest
        # the replacement's (version 1)
        assert c.token_ids[:k] == p.partial.token_ids and c.logprobs[:k] == p.partial.logprobs
        assert got[0, j].versions == [0] * k + [1] * (len(c.token_ids) - k) and len(c.token_ids) == 14
    # the replacement does draw other tokens: the request nobody read started again and differs
    assert all(got[1, j].completion.token_ids != straight[1, j].token_ids for j in range(2))
