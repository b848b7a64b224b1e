"""`Pump`: keeps the rollout stream's bookkeeping going in a background thread of the controller
while it trains (trainer/rollout_stream.py). The replicas decode in threads of their own
(workers/stream.py), but what happens between two turns of a multi-turn trajectory (its finished
turn booked, its environment step polled, its next turn sent), a prompt's group scored and dynamic
sampling's next round drawn, happened only while the controller polled the stream, not while it
trained: a trajectory then stopped at its current turn for the whole update.

One lock guards the stream's state; whoever holds it may change it: the pump for one `tick` (at
most one short poll), or the controller for one call (`held`). The controller goes first: the pump
does not take the lock again while a caller waits for it, so a weight update waits for one tick at
most, and nothing is sent to the replicas while it holds the stream (no decode step can start
between its abort and the new weights).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

IDLE_S = 0.05
"""The pump's wait when nothing is in flight (it checks again after it, or when it is stopped)."""


class Pump:
    """`tick()` returns False when there was nothing to do (the pump then waits `IDLE_S`)."""

    def __init__(self, tick: Callable[[], bool]) -> None:
        self.tick = tick
        self._lock = threading.RLock()
        """Held by whoever changes the stream's state: a caller (`held`) or the pump for one tick."""
        self._gate = threading.Condition()
        """Guards `_callers`; the pump waits on it while a caller wants the lock."""
        self._callers = 0
        """Callers waiting for, or holding, the lock."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        """What the pump's tick raised, raised again in the caller's thread."""

    @contextmanager
    def held(self) -> Iterator[None]:
        """The stream's state for the caller, between two ticks of the pump (ahead of them); raises
        what the pump failed with."""
        with self._gate:
            self._callers += 1
        try:
            with self._lock:
                self._raise()
                yield
        finally:
            with self._gate:
                self._callers -= 1
                self._gate.notify_all()

    @contextmanager
    def running(self) -> Iterator[None]:
        """Tick in a background thread for the block's duration (the controller trains meanwhile);
        on exit, stop the thread and raise what it failed with (unless the block raised)."""
        assert self._thread is None, "the stream's pump is already running"
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="rollout-pump", daemon=True)
        self._thread.start()
        try:
            yield
        finally:
            self._stop.set()
            with self._gate:
                self._gate.notify_all()
            self._thread.join()
            self._thread = None
        with self._lock:
            self._raise()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                with self._gate:
                    self._gate.wait_for(lambda: self._callers == 0 or self._stop.is_set())
                if self._stop.is_set():
                    return
                with self._lock:
                    busy = self.tick()
                if not busy:
                    self._stop.wait(IDLE_S)
        except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
            with self._lock:
                self._error = e

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error
