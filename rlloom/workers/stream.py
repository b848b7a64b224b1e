"""`EngineStream`: generation on one rollout engine's step-level API (`add_request` / `step` /
`abort` / `resume_request`) in a background thread of the process that holds the engine, kept in
flight while the controller trains. The asynchronous loop (trainer/rollout_stream.py) drives it
through the rollout group: directly in one process (cluster.mode=inline), through each rollout
actor with Ray; this is the one place that knows how requests in flight cross a weight update.

Each decode step runs under the stream's lock; the callers take the lock only between two steps
(adding requests, aborting them, polling), so generation overlaps training. Around a weight update
(`rollout.partial`), the caller:
- `abort()`s every request in flight between two decode steps: each unfinished sample keeps its
  tokens, behaviour logprobs and per-token policy versions (the thread stops, nothing is in flight);
- moves the new weights into the engine (any sync: in place, broadcast);
- `resume(keep=True)`: each sample continues from prompt + its tokens so far, the KV cache rebuilt
  by a prefill under the new weights (abort_resume), or `resume(keep=False)`: its tokens are
  discarded and it starts again under the new weights (drop).
A finished sample comes out of `poll()` with the version of each of its tokens.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from rlloom.engines.rollout import Completion, SamplingParams


@dataclass(kw_only=True, slots=True)
class StreamRequest:
    """One prompt to generate `sampling.n` samples of."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    prompt_index: int
    """The engine's prompt index (the prompt's position in its round)."""


@dataclass(kw_only=True, slots=True)
class StreamResult:
    """One finished sample (or a rejected one: `completion.error` set)."""

    completion: Completion
    versions: list[int]
    """The policy version of each of its tokens (older ones first when it resumed across updates)."""


@dataclass(kw_only=True, slots=True)
class _Flight:
    """A request in flight: how many samples are still out, and the tokens of aborted ones."""

    request: StreamRequest
    left: int
    partial: dict[int, tuple[list[int], list[float], list[int]]] = field(default_factory=dict)
    """sample index -> (tokens, logprobs, token versions) kept from an abort."""


class EngineStream:
    """The step-level producer on one in-process rollout engine."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.flights: dict[str, _Flight] = {}
        self.finished: list[StreamResult] = []
        """Samples finished and not yet polled."""
        self.busy_s = 0.0
        """Seconds spent in decode steps (the rollout's busy time)."""
        self._aborting = False
        """True while the completions of our own abort come out (not a rejected request)."""
        self._cond = threading.Condition()
        """Held by every change to the stream and by each decode step: weights change between steps."""
        self._pause = False
        """A caller wants the stream: the generation thread waits before its next step."""
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._news = threading.Event()
        """Set when samples finish, or the thread stops or fails (what `poll` waits for)."""

    def add(self, requests: list[StreamRequest]) -> None:
        """Queue the requests and (re)start the generation thread."""
        with self._held():
            self._raise()
            for r in requests:
                self.flights[r.request_id] = _Flight(request=r, left=max(r.sampling.n, 1))
                self.engine.add_request(
                    r.prompt_ids, r.sampling, request_id=r.request_id, prompt_index=r.prompt_index
                )
            self._start()

    def poll(self, timeout_s: float) -> list[StreamResult]:
        """The samples finished since the last poll, waiting up to `timeout_s` for the first one."""
        self._news.wait(timeout_s)
        with self._held():
            self._news.clear()
            self._raise()
            out, self.finished = self.finished, []
        return out

    def abort(self) -> int:
        """Abort every request in flight between two decode steps, keeping each unfinished sample's
        tokens, logprobs and versions; return their token count. Nothing is in flight afterwards and
        the generation thread has ended (the engine is free for a weight update or `generate`)."""
        with self._held():
            self._raise()
            thread, interrupted = self._thread, 0
            if self.flights:
                self._aborting = True
                try:
                    self.engine.abort(list(self.flights))
                    self._record(self.engine.step())  # nothing else is scheduled: only the aborted come out
                finally:
                    self._aborting = False
                interrupted = sum(len(p[0]) for f in self.flights.values() for p in f.partial.values())
        if thread is not None:
            thread.join()  # it sees nothing in flight and ends
        return interrupted

    def resume(self, keep: bool) -> int:
        """Continue every aborted sample under the engine's current weights: from its tokens so far
        (`keep`) or from scratch; return the tokens discarded (0 with `keep`)."""
        discarded = 0
        with self._held():
            self._raise()
            for request_id, flight in self.flights.items():
                r = flight.request
                for j, (tokens, logprobs, versions) in sorted(flight.partial.items()):
                    if not keep:
                        discarded += len(tokens)
                        tokens, logprobs, versions = [], [], []
                        flight.partial[j] = (tokens, logprobs, versions)
                    self.engine.resume_request(
                        r.prompt_ids,
                        r.sampling,
                        output_ids=tokens,
                        logprobs=logprobs,
                        request_id=request_id,
                        prompt_index=r.prompt_index,
                        sample_index=j,
                    )
            self._start()
        return discarded

    def drop_all(self) -> int:
        """Abort and forget every request and every unpolled sample; return the tokens discarded."""
        discarded = self.abort()
        with self._held():
            discarded += sum(len(s.completion.token_ids) for s in self.finished)
            self.flights.clear()
            self.finished.clear()
        return discarded

    # ---- the generation thread -------------------------------------------------------------------

    @contextmanager
    def _held(self) -> Iterator[None]:
        """Hold the stream between two decode steps (the generation thread waits meanwhile)."""
        self._pause = True
        with self._cond:
            try:
                yield
            finally:
                self._pause = False
                self._cond.notify_all()

    def _start(self) -> None:
        """Start the generation thread unless it runs (call holding the stream)."""
        if self._thread is None and self.engine.has_unfinished():
            self._thread = threading.Thread(target=self._generate, name="rollout-stream", daemon=True)
            self._thread.start()

    def _generate(self) -> None:
        """One decode step at a time under the lock until nothing is in flight."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: not self._pause)
                try:
                    if not self.engine.has_unfinished():
                        self._thread = None
                        self._news.set()
                        return
                    start = time.perf_counter()
                    self._record(self.engine.step())
                    self.busy_s += time.perf_counter() - start
                except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                    self._error, self._thread = e, None
                    self._news.set()
                    return

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _record(self, completions: list[Completion]) -> None:
        for c in completions:
            flight = self.flights[c.request_id]
            if c.finish_reason == "abort" and self._aborting:
                flight.partial[c.sample_index] = _merge(flight, c)  # resumed or restarted by `resume`
                continue
            _, _, before = flight.partial.pop(c.sample_index, ([], [], []))
            self.finished.append(StreamResult(completion=c, versions=_versions(before, c)))
            flight.left -= 1
            if flight.left == 0:
                del self.flights[c.request_id]
        if completions:
            self._news.set()


def _versions(before: list[int], c: Completion) -> list[int]:
    """Per-token versions of a completion that resumed from `len(before)` tokens of known versions
    (the completion repeats those tokens; the ones after carry its own version)."""
    return before + [c.policy_version] * (len(c.token_ids) - len(before))


def _merge(flight: _Flight, c: Completion) -> tuple[list[int], list[float], list[int]]:
    """An aborted sample's tokens, logprobs and per-token versions so far."""
    _, _, versions = flight.partial.pop(c.sample_index, ([], [], []))
    return list(c.token_ids), list(c.logprobs), _versions(versions, c)
