"""The requests of an `EngineStream` (stream.py) and what it keeps of those in flight: how many
samples of each are still out, and the tokens, behaviour logprobs and per-token policy versions
that an abort left of each unfinished sample, for it to resume from (or start again) under new
weights. Plain bookkeeping over a dict of `Flight`s: the stream holds the dict and its lock."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlloom.data.images import ImageInputs
from rlloom.engines.rollout import Completion, Partial, RolloutEngine, SamplingParams

Tokens = tuple[list[int], list[float], list[int]]
"""A sample's tokens so far, their behaviour logprobs and per-token policy versions."""


@dataclass(kw_only=True, slots=True)
class StreamRequest:
    """One prompt to generate `sampling.n` samples of."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    prompt_index: int
    """The engine's prompt index (the prompt's position in its round)."""
    progress: bool = False
    """Report its samples' tokens after each step (`Partial`s from `poll`: a streaming client)."""
    first_sample: int = 0
    """The first sample's index (`RolloutEngine.add_request`)."""
    images: ImageInputs | None = None
    """The prompt's pictures (a vision-language model), encoded once for its n samples."""
    resume: dict[int, Tokens] = field(default_factory=dict)
    """Sample index -> the tokens it continues from (none: it starts). When set, these samples
    alone are made: a streamed request sent again to a replaced replica (`RayRolloutGroup`), whose
    client read the tokens, so the sample trained is the one it read, not a new draw."""


@dataclass(kw_only=True, slots=True)
class StreamResult:
    """One finished sample (or a rejected one: `completion.error` set)."""

    completion: Completion
    versions: list[int]
    """The policy version of each of its tokens (older ones first when it resumed across updates)."""


@dataclass(kw_only=True, slots=True)
class StreamPartial:
    """The tokens so far of one unfinished sample of a `progress` request: what its client is sent."""

    partial: Partial
    versions: list[int]
    """The policy version of each of its tokens."""


@dataclass(kw_only=True, slots=True)
class Flight:
    """A request in flight: how many samples are still out, and the tokens of aborted ones."""

    request: StreamRequest
    left: int
    partial: dict[int, Tokens] = field(default_factory=dict)
    """sample index -> (tokens, logprobs, token versions) kept from an abort (or `request.resume`)."""


def admit(engine: RolloutEngine, flights: dict[str, Flight], r: StreamRequest) -> None:
    """Put request `r` into `engine` and `flights`: its n samples, or the samples of `r.resume`, each
    from its tokens (as after an abort)."""
    if not r.resume:
        flights[r.request_id] = Flight(request=r, left=max(r.sampling.n, 1))
        engine.add_request(
            r.prompt_ids,
            r.sampling,
            request_id=r.request_id,
            prompt_index=r.prompt_index,
            first_sample=r.first_sample,
            images=r.images,
        )
        return
    partial = {j: (list(t), list(lp), list(v)) for j, (t, lp, v) in r.resume.items()}
    flight = flights[r.request_id] = Flight(request=r, left=len(partial), partial=partial)
    resume_all(engine, {r.request_id: flight}, keep=True)


def streamed(flights: dict[str, Flight], partials: list[Partial], version: int) -> list[StreamPartial]:
    """The engine's `partials` of requests in `flights` with their tokens' versions: those it resumed
    from keep theirs, the ones after have the engine's `version`."""
    out = []
    for p in partials:
        _, _, before = flights[p.request_id].partial.get(p.sample_index, ([], [], []))
        out.append(StreamPartial(partial=p, versions=before + [version] * (len(p.token_ids) - len(before))))
    return out


def partial_tokens(flights: dict[str, Flight]) -> int:
    """Tokens the aborted samples of `flights` hold."""
    return sum(len(p[0]) for f in flights.values() for p in f.partial.values())


def record(
    flights: dict[str, Flight], completions: list[Completion], *, aborting: bool
) -> list[StreamResult]:
    """Book a decode step's `completions` into `flights` and return the finished samples. While
    `aborting` (the completions of the stream's own abort), an aborted sample keeps its tokens so
    far for `resume_all`; otherwise an abort is a rejected request and comes out like a finished one."""
    finished = []
    for c in completions:
        flight = flights[c.request_id]
        if c.finish_reason == "abort" and aborting:
            flight.partial[c.sample_index] = _merge(flight, c)  # resumed or restarted by `resume`
            continue
        _, _, before = flight.partial.pop(c.sample_index, ([], [], []))
        finished.append(StreamResult(completion=c, versions=_versions(before, c)))
        flight.left -= 1
        if flight.left == 0:
            del flights[c.request_id]
    return finished


def keeps_tokens(request: StreamRequest, keep: bool) -> bool:
    """Whether an aborted sample of `request` resumes from its tokens so far: under `keep`
    (abort_resume), and always when it is streamed (`progress`): its client has read them and acts
    on them (an agent), so a restart under new weights (drop) would train other tokens than those."""
    return keep or request.progress


def discarded_tokens(flights: dict[str, Flight], keep: bool) -> int:
    """Tokens of the aborted samples of `flights` that a resume (`keep` or not) starts again."""
    return sum(
        len(p[0]) for f in flights.values() if not keeps_tokens(f.request, keep) for p in f.partial.values()
    )


def resume_all(engine: RolloutEngine, flights: dict[str, Flight], *, keep: bool) -> None:
    """Put every aborted sample of `flights` back into `engine`: from its tokens so far
    (`keeps_tokens`), or from scratch (its tokens discarded)."""
    for request_id, flight in flights.items():
        r = flight.request
        for j, (tokens, logprobs, versions) in sorted(flight.partial.items()):
            if not keeps_tokens(r, keep):
                tokens, logprobs, versions = [], [], []
                flight.partial[j] = (tokens, logprobs, versions)
            engine.resume_request(
                r.prompt_ids,
                r.sampling,
                output_ids=tokens,
                logprobs=logprobs,
                request_id=request_id,
                prompt_index=r.prompt_index,
                sample_index=j,
                images=r.images,
            )


def _versions(before: list[int], c: Completion) -> list[int]:
    """Per-token versions of a completion that resumed from `len(before)` tokens of known versions
    (the completion repeats those tokens; the ones after carry its own version)."""
    return before + [c.policy_version] * (len(c.token_ids) - len(before))


def _merge(flight: Flight, c: Completion) -> Tokens:
    """An aborted sample's tokens, logprobs and per-token versions so far."""
    _, _, versions = flight.partial.pop(c.sample_index, ([], [], []))
    return list(c.token_ids), list(c.logprobs), _versions(versions, c)
