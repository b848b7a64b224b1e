"""The one free-port helper of the benchmark scripts (they must not import tests/, and rlloom has no
public one): a rendezvous port for the process groups a benchmark starts."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port free on this host now (for a process group's or a sync group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
