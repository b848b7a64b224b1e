"""`free_port`: the rendezvous ports of multi-process runs and tests come from outside the kernel's
ephemeral range, so no outgoing connection can take one before its store listens on it (CI once
failed 17 tests on EADDRINUSE with a port that binding port 0 had handed out)."""

from __future__ import annotations

import socket

from rlloom.parallel import distributed
from rlloom.parallel.distributed import _ephemeral_range, free_port


def test_ports_lie_outside_the_ephemeral_range_and_are_not_repeated():
    low, high = _ephemeral_range()
    ports = [free_port() for _ in range(64)]
    assert all(not low <= p <= high for p in ports), ports
    assert len(set(ports)) == len(ports)


def test_a_port_someone_listens_on_is_not_handed_out(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("", free_port()))
        taken.listen()
        busy = taken.getsockname()[1]
        monkeypatch.setattr(distributed, "_PORTS_GIVEN", set())  # only the bind can refuse it now
        draws = iter([busy, busy, busy - 1])
        monkeypatch.setattr("random.SystemRandom.randint", lambda self, a, b: next(draws))
        assert free_port() == busy - 1
