"""`EngineStream` (workers/stream.py) on the tiny checkpoint: samples aborted mid-response while the
generation thread runs, then resumed (or restarted), end exactly as an uninterrupted `generate`
(seeded sampling, same weights), with each token's policy version; and a replica of two
tensor-parallel ranks (stream_ranks.py) follows its rank 0's steps."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from procs import spawn
from stream_ranks import TIMEOUT_S, run_rank, run_schedule

import rlloom.models as models
from rlloom.engines.rollout.native import NativeEngine, SamplingParams
from rlloom.models.adapter import hf_named_tensors
from rlloom.workers.flights import StreamRequest, StreamResult
from rlloom.workers.stream import EngineStream

PROMPTS = [[5, 6, 7, 8, 9], [11, 3]]
PARAMS = SamplingParams(n=2, temperature=1.0, max_new_tokens=14, seed=3, ignore_eos=True)


def _engine(path) -> NativeEngine:
    return NativeEngine(
        models.from_pretrained(path, fused_projections=True), max_model_len=64, num_blocks=64, block_size=4
    )


def _interrupted_stream(path, *, streamed: bool = False) -> tuple[EngineStream, int]:
    """A stream whose requests were aborted after 4 or more decode steps (of 14 tokens); `streamed`:
    the first prompt's request reports its tokens as they are sampled (`progress`)."""
    engine = _engine(path)
    step, steps, four = engine.step, [], threading.Event()

    def counted():
        steps.append(1)
        if len(steps) >= 4:
            four.set()
        time.sleep(0.01)
        return step()

    engine.step = counted
    stream = EngineStream(engine)
    stream.add(
        [
            StreamRequest(
                request_id=str(i), prompt_ids=p, sampling=PARAMS, prompt_index=i, progress=streamed and i == 0
            )
            for i, p in enumerate(PROMPTS)
        ]
    )
    assert four.wait(30)
    interrupted = stream.abort()
    assert interrupted > 0 and not engine.has_unfinished() and stream._thread is None
    engine.update_weights(list(hf_named_tensors(engine.model)), version=1)  # same weights, a new version
    return stream, interrupted


def _collect(stream: EngineStream, count: int) -> dict:
    out = {}
    deadline = time.monotonic() + 60
    while len(out) < count and time.monotonic() < deadline:
        for r in stream.poll(0.5):
            if isinstance(r, StreamResult):  # not a streamed request's tokens so far
                out[(r.completion.prompt_index, r.completion.sample_index)] = r
    return out


@pytest.mark.parametrize("keep", [True, False], ids=["abort_resume", "drop"])
def test_interrupted_samples_end_as_uninterrupted_ones(tiny_checkpoint, keep):
    straight = {
        (c.prompt_index, c.sample_index): c for c in _engine(tiny_checkpoint).generate(PROMPTS, PARAMS)
    }
    stream, interrupted = _interrupted_stream(tiny_checkpoint)
    assert stream.resume(keep=keep) == (0 if keep else interrupted)
    got = _collect(stream, len(straight))
    assert got.keys() == straight.keys() and not stream.flights
    mixed = 0
    for key, r in got.items():
        c, ref = r.completion, straight[key]
        assert c.token_ids == ref.token_ids
        torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(ref.logprobs), atol=1e-5, rtol=0)
        assert r.versions == sorted(r.versions) and len(r.versions) == len(c.token_ids)
        mixed += len(set(r.versions)) > 1
    # resumed: the tokens before the abort keep version 0, the rest have version 1; restarted: one
    # version per sample
    assert mixed > 0 if keep else mixed == 0
    assert stream.drop_all() == 0


def test_a_streamed_sample_continues_from_its_tokens_where_the_others_are_dropped(tiny_checkpoint):
    """partial=drop starts an interrupted sample again under the new weights, but a streamed one (an
    agent's `stream=true` request) continues from its tokens: its client has read them and acts on
    them, so a restart would train other tokens than those the agent saw."""
    straight = {
        (c.prompt_index, c.sample_index): c for c in _engine(tiny_checkpoint).generate(PROMPTS, PARAMS)
    }
    stream, interrupted = _interrupted_stream(tiny_checkpoint, streamed=True)
    streamed = sum(len(p[0]) for p in stream.flights["0"].partial.values())
    assert 0 < streamed < interrupted
    assert stream.resume(keep=False) == interrupted - streamed  # only the plain request's are discarded
    got = _collect(stream, len(straight))
    assert got.keys() == straight.keys()
    for (prompt, j), r in got.items():
        assert r.completion.token_ids == straight[prompt, j].token_ids  # the same weights, seeded
        # the streamed prompt's tokens before the abort keep version 0; the other restarted at 1
        assert (len(set(r.versions)) > 1) == (prompt == 0), (prompt, j, r.versions)
    assert stream.drop_all() == 0


def test_drop_all_frees_the_engine(tiny_checkpoint):
    stream, interrupted = _interrupted_stream(tiny_checkpoint)
    stream.resume(keep=True)
    assert stream.drop_all() >= interrupted and not stream.flights and not stream.finished
    assert len(stream.engine.generate(PROMPTS, PARAMS)) == 4  # nothing of the stream is left in the engine


def test_tp2_replica_follows_rank_0(tiny_checkpoint, tmp_path):
    """rollout.tp = 2: both ranks admit, abort and resume at rank 0's steps and take the new weights
    between the same two steps, so the replica's samples equal the same schedule at tp = 1 (tokens,
    per-token versions, logprobs within 1e-5). Ranks out of step report it within the stream's
    timeout instead of hanging."""
    ranks = spawn(
        run_rank,
        args=(2, str(tmp_path / "rendezvous"), str(tiny_checkpoint), str(tmp_path / "out")),
        nprocs=2,
        join=False,
    )
    want = run_schedule(tiny_checkpoint)  # tp = 1, while the ranks run
    deadline = time.monotonic() + 4 * TIMEOUT_S
    while not ranks.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ranks.processes:
                p.kill()
            pytest.fail("the tensor-parallel ranks hang")
    got = torch.load(tmp_path / "out", weights_only=False)
    assert [g[:3] + g[4:] for g in got] == [w[:3] + w[4:] for w in want]
    worst = max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g[3], w[3]))
    assert worst <= 1e-5, worst
    assert all(0 < v.count(0) < len(v) for *_, v in got)  # every sample resumed across the update
    # out of step on purpose: rank 1 lacks a request that rank 0 admitted
    assert "acted on 2 requests that this rank was not given" in (tmp_path / "out.1").read_text()
    assert "one decode step has not ended in 2.0 s" in (tmp_path / "out.0").read_text()


def test_an_abort_after_every_request_finished_settles_the_engines_last_step(tiny_checkpoint):
    """The engine's steps are pipelined: the step that finishes the last sequence has launched one
    more. An abort arriving then (the synchronous step's `idle` after its job completed) must settle
    that step, or the next `generate` (the evaluation) finds the engine busy."""
    from rlloom.workers.stream import StepCommand

    engine = _engine(tiny_checkpoint)
    stream = EngineStream(engine)
    every_token = list(range(engine.model.args.vocab_size))  # the first token stops it, unforeseen
    engine.add_request(
        [5, 6, 7], SamplingParams(max_new_tokens=8, stop_token_ids=every_token), request_id="a"
    )
    while not (done := engine.step()):
        pass
    assert done[0].request_id == "a" and engine.has_unfinished()  # a launched step is still in flight
    with stream._cond:
        assert stream._apply(StepCommand(abort=True)) is False
    assert not engine.has_unfinished()
    assert len(engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))) == 1
