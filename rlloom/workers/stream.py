"""`EngineStream`: generation on one rollout engine's step-level API (`add_request` / `step` /
`abort` / `resume_request`) in a background thread of the process that holds the engine, kept in
flight while the controller trains. The asynchronous loop (trainer/rollout_stream.py) drives it
through the rollout group: directly in one process (cluster.mode=inline), through each rollout
actor with Ray; this is the one place that knows how requests in flight cross a weight update.

The callers only state what they want (`add`, `abort`, `resume`); the generation thread acts on it
between two decode steps: the replica's rank 0 decides a `StepCommand` (admit, resume, abort), every
rank applies it, then all take the same decode step. A replica of rollout.tp > 1 ranks (one stream
per rank, the same calls on each) gets rank 0's command over `group`, a gloo group of its ranks, so
its tensor-parallel collectives stay in lock-step (as nano-vllm's rank 0 drives its workers); at
rollout.tp = 1 nothing is sent. Around a weight update (`rollout.partial`), the caller:
- `abort()`s every request in flight at the next step boundary: each unfinished sample keeps its
  tokens, behaviour logprobs and per-token policy versions, and the thread ends (nothing in flight,
  the engine free for a weight update or `generate`); with nothing in flight it only waits for the
  thread to end (partial=finish: every rank is idle before the weights change);
- moves the new weights into the engine (any sync: in place, broadcast);
- `resume(keep=True)`: each sample continues from prompt + its tokens so far, the KV cache rebuilt
  by a prefill under the new weights (abort_resume), or `resume(keep=False)`: its tokens are
  discarded and it starts again under the new weights (drop); a streamed sample (`progress`), whose
  client has read its tokens, continues from them either way.
A finished sample comes out of rank 0's `poll()` with the version of each of its tokens; a request
that asks for `progress` also gets its unfinished samples' tokens so far (`StreamPartial`, the newest
of each, with their versions) after every step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlloom.engines.rollout import Completion, RolloutEngine
from rlloom.workers.flights import (
    Flight,
    StreamPartial,
    StreamRequest,
    StreamResult,
    admit,
    discarded_tokens,
    partial_tokens,
    record,
    resume_all,
    streamed,
)


@dataclass(frozen=True, slots=True)
class StepCommand:
    """What every rank of a replica does at one step boundary, as its rank 0 decided: resume, then
    admit, then abort."""

    admit: int = 0
    """The first `admit` queued requests enter the engine."""
    resume: int = 0
    """0: nothing; 1: the aborted samples resume from their tokens; 2: they start again."""
    abort: bool = False
    """Abort every request in flight; the thread then ends."""


class EngineStream:
    """The step-level producer on one in-process rollout engine (or one rank of a replica's)."""

    def __init__(
        self, engine: RolloutEngine, *, group: dist.ProcessGroup | None = None, timeout_s: float = 600.0
    ) -> None:
        self.engine = engine
        self.group = group
        """The replica's ranks (gloo), rank 0 first; None for a one-rank replica."""
        self.rank = 0 if group is None else dist.get_rank(group)
        """Rank in the replica: rank 0 decides each step and reports the samples."""
        self.timeout_s = timeout_s
        """Longest step boundary plus decode step before `poll` reports a hang (cluster.timeout_s)."""
        self.flights: dict[str, Flight] = {}
        """Requests in flight (flights.py)."""
        self.finished: list[StreamResult] = []
        """Samples finished and not yet polled (rank 0 only)."""
        self.progress: dict[tuple[str, int], StreamPartial] = {}
        """The newest tokens so far of the unfinished samples that asked for them, not yet polled."""
        self.busy_s = 0.0
        """Seconds spent in decode steps."""
        self._queued: list[StreamRequest] = []
        """Requests added and not yet admitted, in the order rank 0 admits them."""
        self._resume: bool | None = None
        """A resume asked for and not yet done: keep the tokens (True) or start again (False)."""
        self._abort = False
        """Rank 0: an abort asked for and not yet done."""
        self._aborting = False
        """True while the completions of our own abort come out (not a rejected request)."""
        self._cond = threading.Condition()
        """Held by every change to the stream and by each decode step: weights change between steps."""
        self._pause = False
        """A caller wants the stream: the generation thread waits before its next step."""
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._since: float | None = None
        """When the thread's current step (boundary and decode) began; None between steps."""
        self._news = threading.Event()
        """Set when samples finish, or the thread stops or fails (what `poll` waits for)."""

    def add(self, requests: list[StreamRequest]) -> None:
        """Queue the requests (admitted at the next step boundary) and (re)start the thread."""
        with self._held():
            self._raise()
            self._queued += requests
            self._start()

    def poll(self, timeout_s: float) -> list[StreamResult | StreamPartial]:
        """The samples finished since the last poll, after the tokens so far of those still going
        that asked for them; waiting up to `timeout_s` for the first one (at once on ranks other than
        0, which report none); raises the thread's failure, or a hang. Rank 0 with no news returns
        at once, not waiting for the step in flight to end (the caller goes back to its other work:
        an agent's requests, environment results)."""
        if self.rank == 0 and not self._news.wait(timeout_s):
            self._check_progress()
            return []
        with self._held():
            self._news.clear()
            self._raise()
            out, self.finished = self.finished, []
            progress, self.progress = self.progress, {}
        done = {(x.completion.request_id, x.completion.sample_index) for x in out}
        return [p for key, p in progress.items() if key not in done] + out

    def abort(self) -> int:
        """Abort every request in flight at the next step boundary (rank 0 decides it for the
        replica), keeping each unfinished sample's tokens, logprobs and versions; wait until the
        thread has ended and return their token count (0 when nothing was in flight)."""
        with self._held():
            self._raise()
            thread = self._thread
            self._abort = thread is not None and self.rank == 0
        if thread is not None:
            thread.join(self.timeout_s)
            if thread.is_alive():
                raise TimeoutError(
                    f"{self._who}: the generation thread did not stop within {self.timeout_s} s"
                )
        with self._held():
            self._raise()
            return partial_tokens(self.flights)

    def resume(self, keep: bool) -> int:
        """Continue every aborted sample under the engine's current weights: from its tokens so far
        (`keep`, or a streamed one: `flights.keeps_tokens`) or from scratch; return the tokens
        discarded."""
        with self._held():
            self._raise()
            if not any(f.partial for f in self.flights.values()):
                return 0
            discarded = discarded_tokens(self.flights, keep)
            self._resume = keep
            self._start()
        return discarded

    def drop_all(self) -> int:
        """Abort and forget every request and every unpolled sample; return the tokens discarded."""
        discarded = self.abort()
        with self._held():
            discarded += sum(len(s.completion.token_ids) for s in self.finished)
            self.flights.clear()
            self.finished.clear()
            self.progress.clear()
            self._queued.clear()
            self._resume = None
        return discarded

    # ---- the generation thread -------------------------------------------------------------------

    @contextmanager
    def _held(self) -> Iterator[None]:
        """Hold the stream between two decode steps (the generation thread waits meanwhile); raise
        instead of waiting on a step that hangs."""
        self._pause = True
        try:
            while not self._cond.acquire(timeout=0.5):
                self._check_progress()
        except BaseException:
            self._pause = False
            raise
        try:
            yield
        finally:
            self._pause = False
            self._cond.notify_all()
            self._cond.release()

    def _start(self) -> None:
        """Start the generation thread unless it runs (call holding the stream)."""
        waiting = self._queued or self._resume is not None or self.engine.has_unfinished()
        if self._thread is None and waiting:
            self._thread = threading.Thread(target=self._generate, name="rollout-stream", daemon=True)
            self._thread.start()

    def _generate(self) -> None:
        """Each step: rank 0's command, shared with the replica's ranks and applied by each, then one
        decode step; until nothing is in flight or waiting (or an abort)."""
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: not self._pause)
                    self._since = time.monotonic()
                    command = self._decide() if self.rank == 0 else StepCommand()
                command = self._share(command)  # outside the lock: the callers still get in
                with self._cond:
                    self._cond.wait_for(lambda: not self._pause)
                    if self._apply(command):
                        start = time.perf_counter()
                        self._record(self.engine.step())
                        self.busy_s += time.perf_counter() - start
                    elif not (self._queued or self._resume is not None):
                        self._thread, self._since, self._abort = None, None, False
                        self._news.set()
                        return
                    self._since = None
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            self._error, self._thread, self._since = e, None, None
            self._news.set()

    def _decide(self) -> StepCommand:
        """Rank 0: everything asked for so far."""
        resume = 0 if self._resume is None else 1 if self._resume else 2
        return StepCommand(admit=len(self._queued), resume=resume, abort=self._abort)

    def _share(self, command: StepCommand) -> StepCommand:
        """Rank 0's command on every rank of the replica."""
        if self.group is None:
            return command
        t = torch.tensor([command.admit, command.resume, int(command.abort)], dtype=torch.int64)
        dist.broadcast(t, group=self.group, group_src=0)
        admit, resume, abort = t.tolist()
        return StepCommand(admit=admit, resume=resume, abort=bool(abort))

    def _apply(self, command: StepCommand) -> bool:
        """Resume, admit, abort as `command` says (call holding the stream); whether a decode step
        follows (False: nothing in flight, or aborted)."""
        if command.resume:
            self._wait_for(lambda: self._resume is not None, "a resume")
            resume_all(self.engine, self.flights, keep=command.resume == 1)
            self._resume = None
        if command.admit:
            self._wait_for(lambda: len(self._queued) >= command.admit, f"{command.admit} requests")
            admitted, self._queued = self._queued[: command.admit], self._queued[command.admit :]
            for r in admitted:
                admit(self.engine, self.flights, r)
        if not command.abort:
            return self.engine.has_unfinished()
        self._abort = False
        if self.flights:
            self._aborting = True
            try:
                self.engine.abort(list(self.flights))
                self._record(self.engine.step())  # nothing else is scheduled: only the aborted come out
            finally:
                self._aborting = False
        while self.engine.has_unfinished():
            # Every request finished, but the engine launched one more step before it knew (its steps
            # are pipelined): settle it, or the engine's next user (an evaluation's `generate`) finds
            # it still busy. The step's tokens belong to finished sequences: nothing comes out.
            self._record(self.engine.step())
        return False

    def _wait_for(self, ready: Callable[[], bool], what: str) -> None:
        """A rank other than 0 waits for the call that brings what rank 0's command uses (timed
        here, not by `poll`'s hang check)."""
        self._since = None
        if not self._cond.wait_for(ready, timeout=self.timeout_s):
            raise RuntimeError(
                f"{self._who}: rank 0 of the replica acted on {what} that this rank was not given "
                f"within {self.timeout_s} s: every rank of a replica must receive the same stream calls"
            )
        self._since = time.monotonic()

    @property
    def _who(self) -> str:
        return f"rollout stream (rank {self.rank} of its replica)"

    def _check_progress(self) -> None:
        since = self._since
        if since is not None and time.monotonic() - since > self.timeout_s:
            raise TimeoutError(
                f"{self._who}: one decode step has not ended in {self.timeout_s} s "
                "(the replica's ranks are out of step, or one of them is gone)"
            )

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _record(self, completions: list[Completion]) -> None:
        finished = record(self.flights, completions, aborting=self._aborting)
        if self.rank != 0:
            return
        self.finished += finished
        watched = {rid for rid, f in self.flights.items() if f.request.progress}
        partial = (
            [p for p in self.engine.partial(watched) if p.token_ids] if watched and not self._aborting else []
        )
        for p in streamed(self.flights, partial, self.engine.policy_version):
            self.progress[p.partial.request_id, p.partial.sample_index] = p
        if completions or partial:
            self._news.set()
