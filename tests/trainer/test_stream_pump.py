"""The rollout stream's pump (rlloom/trainer/stream_pump.py): no tick while a caller holds the stream,
callers go ahead of a busy pump, and a tick's failure reaches the caller's thread."""

from __future__ import annotations

import threading
import time

import pytest

from rlloom.trainer.stream_pump import Pump


def test_no_tick_runs_while_a_caller_holds_the_stream_and_callers_go_first():
    inside, ticks, overlaps = threading.Event(), [], []

    def tick() -> bool:  # always busy, holding the interpreter: it would take the lock again at once
        if inside.is_set():
            overlaps.append(time.monotonic())
        ticks.append(time.monotonic())
        end = time.monotonic() + 0.01
        while time.monotonic() < end:
            pass
        return True

    pump = Pump(tick)
    waits = []
    with pump.running():
        for _ in range(20):
            start, started = time.monotonic(), len(ticks)
            with pump.held():
                waits.append((time.monotonic() - start, len(ticks) - started))
                inside.set()
                before = len(ticks)
                time.sleep(0.02)
                assert len(ticks) == before  # the pump waited for the caller
                inside.clear()
            time.sleep(0.02)
    assert not overlaps and len(ticks) > 20
    # The caller waits for the tick under way at most (10 ms; room for a loaded machine), not for a
    # pump that takes the lock again and again.
    assert max(w for w, _ in waits) < 0.2 and max(n for _, n in waits) <= 2, waits


def test_a_ticks_failure_is_raised_in_the_callers_thread():
    def tick() -> bool:
        raise ValueError("rollout rejected prompt 3")

    pump = Pump(tick)
    with pytest.raises(ValueError, match="prompt 3"):
        with pump.running():
            time.sleep(0.1)
    with pump.running():  # raised once; the pump runs again
        time.sleep(0.05)
        with pytest.raises(ValueError, match="prompt 3"):
            with pump.held():
                pass


def test_an_idle_pump_waits_and_stops_at_once():
    calls = []
    pump = Pump(lambda: calls.append(1) or False)
    start = time.monotonic()
    with pump.running():
        time.sleep(0.2)
    assert time.monotonic() - start < 1.0 and 1 <= len(calls) <= 10  # IDLE_S apart, not spinning
