"""Start a test's worker processes from one fork server that has imported torch, transformers and
rlloom once, instead of a fresh interpreter per process (`torch.multiprocessing.spawn`'s default).

Each spawned interpreter spends about 6 s of CPU importing the stack; the multi-process tests start
dozens of them, a large share of the suite's time on 2 cores. The server never runs a parallel CPU
kernel, so forking it is safe (forking the test process itself, after OpenMP started, is not).
A forked child would see the environment of the server's start; `spawn` hands each child the test
process's environment of the moment instead, as a fresh interpreter would see it.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch.multiprocessing as mp

from rlloom.parallel.distributed import free_port  # noqa: F401  (the tests' rendezvous ports)

PRELOAD = [
    "torch",
    "torch.distributed",
    "transformers",
    "rlloom.engines.train.native.engine",
    "rlloom.engines.rollout.native.engine",
    "rlloom.parallel.parallelize",
]


def spawn(fn: Callable, args: tuple = (), nprocs: int = 1, join: bool = True):  # noqa: ANN201
    """`torch.multiprocessing.spawn(fn, args, nprocs, join)`, the processes forked from the server."""
    mp.get_context("forkserver").set_forkserver_preload(PRELOAD)  # takes effect when it first starts
    return mp.start_processes(
        _in_environment,
        args=(dict(os.environ), fn, args),
        nprocs=nprocs,
        join=join,
        start_method="forkserver",
    )


def _in_environment(rank: int, environ: dict[str, str], fn: Callable, args: tuple) -> None:
    os.environ.clear()
    os.environ.update(environ)
    fn(rank, *args)
