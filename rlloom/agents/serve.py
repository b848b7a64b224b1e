"""`serve(engine, endpoint, fmt, limits)`: the endpoint outside training (`rlloom serve`): each request
is one engine request (its n choices the prompt's samples) on the step-level stream
(workers/stream.py), so requests are batched together as they arrive; a streaming request is sent
its tokens as they are sampled. No ledger is kept; sampling is
the request's (OpenAI's defaults: temperature 1, top_p 1), its max_tokens capped by the context
budget."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from rlloom.agents.api import Answer, ApiError, Choice, Delta, GenRequest
from rlloom.agents.server import Call, Endpoint
from rlloom.agents.turns import Formats, StreamCursor, make_choice, prompt_ids, render_prompt
from rlloom.engines.rollout import Partial, RolloutEngine, SamplingParams
from rlloom.workers.flights import StreamPartial, StreamRequest
from rlloom.workers.stream import EngineStream


@dataclass(frozen=True, slots=True)
class Limits:
    """The served model's budget and defaults (from the run's or the default settings)."""

    max_total_tokens: int
    """Prompt plus answer (the engine's longest sequence)."""
    max_new_tokens: int
    """A request's max_tokens when it gives none."""
    stop_token_ids: list[int]
    stop_strings: list[str]
    """The run's stop strings (the model's answer format), besides the request's own."""


@dataclass(kw_only=True, slots=True)
class _Pending:
    call: Call
    request: GenRequest
    prompt_tokens: int
    choices: list[Choice | None]
    cursors: list[StreamCursor]
    """A streaming request: what of each choice was sent so far."""


def _start(call: Call, fmt: Formats, limits: Limits, request_id: str) -> StreamRequest | Answer | ApiError:
    """The engine request for `call`, or its answer when there is nothing to generate."""
    req = call.request
    try:
        ids = prompt_ids(fmt, render_prompt(fmt, req))
    except Exception as e:  # noqa: BLE001 - a template error on the client's messages is its request's
        return ApiError(400, f"the chat template cannot render these messages: {type(e).__name__}: {e}")
    room = limits.max_total_tokens - len(ids)
    if room < 1:
        empty = Choice(token_ids=[], logprobs=[], pieces=[], text="", finish_reason="length")
        return Answer(choices=[empty] * req.n, prompt_tokens=len(ids))
    sampling = SamplingParams(
        n=req.n,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        max_new_tokens=min(req.max_tokens or limits.max_new_tokens, room),
        stop_token_ids=list(limits.stop_token_ids),
        stop_strings=[*limits.stop_strings, *req.stop],
        seed=req.seed,
    )
    return StreamRequest(
        request_id=request_id, prompt_ids=ids, sampling=sampling, prompt_index=0, progress=req.stream
    )


def _send(p: _Pending | None, partial: Partial) -> None:
    """Send a streaming request what may be sent of a choice's tokens so far."""
    if p is None or not p.request.stream:
        return
    pieces, logprobs = p.cursors[partial.sample_index].advance(partial.token_ids, partial.logprobs)
    if pieces:
        p.call.send(Delta(index=partial.sample_index, pieces=pieces, logprobs=logprobs))


def serve(
    engine: RolloutEngine, endpoint: Endpoint, fmt: Formats, limits: Limits, *, stop: Callable[[], bool]
) -> None:
    """Answer the endpoint's requests until `stop()` holds."""
    stream = EngineStream(engine)
    pending: dict[str, _Pending] = {}
    ids = itertools.count()
    while not stop():
        for call in endpoint.take(0.0 if pending else 0.05):
            request_id = str(next(ids))
            started = _start(call, fmt, limits, request_id)
            if not isinstance(started, StreamRequest):
                call.reply(started)
                continue
            pending[request_id] = _Pending(
                call=call,
                request=call.request,
                prompt_tokens=len(started.prompt_ids),
                choices=[None] * call.request.n,
                cursors=[StreamCursor(fmt=fmt, req=call.request) for _ in range(call.request.n)],
            )
            stream.add([started])
        if not pending:
            continue
        for result in stream.poll(0.01):
            if isinstance(result, StreamPartial):
                _send(pending.get(result.partial.request_id), result.partial)
                continue
            c = result.completion
            p = pending.get(c.request_id)
            if p is None:
                continue  # another choice of a request already answered with an error
            if c.error is not None:
                del pending[c.request_id]
                p.call.reply(ApiError(400, f"the engine rejected the request: {c.error}"))
                continue
            p.choices[c.sample_index] = make_choice(
                fmt, p.request, list(c.token_ids), list(c.logprobs), c.finish_reason
            )
            if all(ch is not None for ch in p.choices):
                del pending[c.request_id]
                p.call.reply(Answer(choices=list(p.choices), prompt_tokens=p.prompt_tokens))
    stream.drop_all()
