"""One schedule on an `EngineStream`, run by each rank of a tensor-parallel replica (gloo on CPU,
spawned by test_workers_stream.py) and at tp = 1 in the test's own process: requests added, aborted
after exactly `ABORT_AFTER` decode steps of rank 0, other weights loaded under version 1, the samples
resumed. Rank 0 decides every step; the other ranks only make the same calls. Then the ranks go out
of step on purpose (`out_of_step`): each must report it within the stream's timeout, not hang."""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import rlloom.models as models
from rlloom.engines.rollout.native import NativeEngine, SamplingParams
from rlloom.workers.flights import StreamRequest
from rlloom.workers.stream import EngineStream

PROMPTS = [[5, 6, 7, 8, 9], [11, 3]]
PARAMS = SamplingParams(n=2, temperature=1.0, max_new_tokens=14, seed=3, ignore_eos=True)
ABORT_AFTER = 4
TIMEOUT_S = 30.0
"""The stream's hang timeout: a rank out of step fails the test instead of blocking it."""

Result = tuple[int, int, list[int], list[float], list[int]]


def new_weights(path) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's weights plus seeded noise: enough to change the sampled tokens."""
    g = torch.Generator().manual_seed(7)
    tensors = models.hf_named_tensors(models.from_pretrained(path))
    return [(n, t + 0.05 * torch.randn(t.shape, generator=g)) for n, t in tensors]


def _abort_after(stream: EngineStream, steps: int) -> threading.Event:
    """Rank 0's decode step number `steps` returns only once a caller waits for the stream, so the
    abort asked for then takes effect exactly at the boundary after it (not a step later)."""
    engine, real, count, reached = stream.engine, stream.engine.step, [0], threading.Event()

    def step():
        out = real()
        count[0] += 1
        if count[0] == steps:
            reached.set()
            deadline = time.monotonic() + TIMEOUT_S
            while not stream._pause and time.monotonic() < deadline:
                time.sleep(0.001)
        return out

    engine.step = step
    return reached


def run_schedule(path, group: dist.ProcessGroup | None = None, control=None) -> list[Result] | None:
    """Rank 0's finished samples (None on the other ranks, which return once their thread ends)."""
    engine = NativeEngine(
        models.from_pretrained(path, fused_projections=True),
        max_model_len=64,
        num_blocks=64,
        block_size=4,
        seed=0,
        tp_group=group,
    )
    stream = EngineStream(engine, group=control, timeout_s=TIMEOUT_S)
    reached = _abort_after(stream, ABORT_AFTER) if stream.rank == 0 else None
    stream.add(
        [
            StreamRequest(request_id=str(i), prompt_ids=p, sampling=PARAMS, prompt_index=i)
            for i, p in enumerate(PROMPTS)
        ]
    )
    if reached is not None:
        assert reached.wait(TIMEOUT_S)
    assert stream.abort() > 0  # every rank: the tokens of the samples in flight
    engine.update_weights(new_weights(path), version=1)
    stream.resume(keep=True)
    out: dict[tuple[int, int], Result] = {}
    deadline = time.monotonic() + 2 * TIMEOUT_S
    while (stream._thread is not None or stream.rank == 0 and len(out) < 4) and time.monotonic() < deadline:
        for r in stream.poll(0.2):
            c = r.completion
            out[(c.prompt_index, c.sample_index)] = (
                c.prompt_index,
                c.sample_index,
                c.token_ids,
                c.logprobs,
                r.versions,
            )
        time.sleep(0.01 if stream.rank == 0 else 0.05)
    assert stream._thread is None, "the stream did not finish"
    return [out[k] for k in sorted(out)] if stream.rank == 0 else None


def out_of_step(rank: int, path, group: dist.ProcessGroup, out: str) -> None:
    """Rank 1 is given one request fewer than rank 0: rank 1 names the missing call, rank 0's poll
    reports its decode step that cannot end (the first error of each goes to `out`.rank)."""
    short = 2.0
    control = dist.new_group([0, 1], backend="gloo", timeout=timedelta(seconds=short))
    engine = NativeEngine(
        models.from_pretrained(path, fused_projections=True),
        max_model_len=64,
        num_blocks=64,
        block_size=4,
        tp_group=group,
    )
    stream = EngineStream(engine, group=control, timeout_s=short)
    requests = [
        StreamRequest(request_id=str(i), prompt_ids=p, sampling=PARAMS, prompt_index=i)
        for i, p in enumerate(PROMPTS)
    ]
    stream.add(requests if rank == 0 else requests[:1])
    error, deadline = "no error", time.monotonic() + 10 * short
    while error == "no error" and time.monotonic() < deadline:
        try:
            stream.poll(0.1)
        except Exception as e:  # noqa: BLE001 - what the test reads
            error = f"{type(e).__name__}: {e}"
    Path(f"{out}.{rank}").write_text(error)
    while rank == 1 and not Path(f"{out}.0").exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # rank 0 reports first (rank 1 leaving would end rank 0's step otherwise)


def run_rank(rank: int, world: int, rendezvous: str, path: str, out: str) -> None:
    """torch.multiprocessing.spawn target: the schedule at tp = world (rank 0 saves its samples to
    `out`), then `out_of_step` (each rank's error to `out`.rank). The process exits at once: a thread
    of rank 0 stays in its collective."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    control = dist.new_group(list(range(world)), backend="gloo", timeout=timedelta(seconds=TIMEOUT_S))
    result = run_schedule(path, dist.group.WORLD, control)
    if rank == 0:
        torch.save(result, out)
    out_of_step(rank, path, dist.group.WORLD, out)
    os._exit(0)
