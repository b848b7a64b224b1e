"""`RewardRunner`: scores (response, ground truth) pairs so that no reward function can stall or kill
the training loop.

With `num_workers=0` the function runs inline in this process: the right choice for the cheap,
trusted built-ins; there is no timeout then. With `num_workers >= 1` each sample runs in a
worker process with a per-sample deadline of `timeout_s`: a worker that misses it is killed and
replaced, so a call returns at most about `timeout_s` after its last sample started. Workers
start with "forkserver" (fresh processes forked from a small server that never imported torch;
"spawn" where forkserver does not exist) and live across calls until `close()`.

A sample whose function hangs, raises, crashes its process, or returns None / NaN / inf /
something that is not a number gets `default_score`, and is counted in the metrics
`reward/timeouts`, `reward/errors` and `reward/invalid`. Scores come back in input order.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import pickle
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

from rlloom.rewards.worker import run_one, worker_main

logger = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 60.0  # a worker not ready by then is broken (e.g. an import that hangs)
_POLL_S = 0.5  # longest single wait, so startup problems are noticed while nothing is busy


@dataclass(kw_only=True, slots=True)
class RewardScores:
    """The scores of one call, in input order, with the failures counted."""

    scores: list[float]
    num_timeouts: int = 0
    num_errors: int = 0
    num_invalid: int = 0

    def metrics(self) -> dict[str, float]:
        return {
            "reward/timeouts": float(self.num_timeouts),
            "reward/errors": float(self.num_errors),
            "reward/invalid": float(self.num_invalid),
        }


@dataclass(slots=True)
class _Worker:
    """One worker process, its pipe, and the sample it is busy with."""

    process: BaseProcess
    conn: Connection
    started_at: float
    ready: bool = False
    task: int | None = None
    deadline: float = 0.0

    def kill(self) -> None:
        self.conn.close()
        if self.process.is_alive():
            self.process.kill()  # SIGKILL: a hung function may ignore SIGTERM
        self.process.join(timeout=2.0)


class RewardRunner:
    """Scores responses with a reward function, inline or in worker processes with timeouts.

    Example: `with RewardRunner(get_reward_fn("number"), num_workers=2, timeout_s=5.0) as runner:
    result = runner.score([("12 + 35 = 47", "47")])` -> `result.scores == [1.0]`.
    """

    def __init__(
        self,
        fn: Callable[[str, str], object],
        *,
        num_workers: int = 0,
        timeout_s: float = 10.0,
        default_score: float = 0.0,
        start_method: str | None = None,
    ) -> None:
        if num_workers < 0:
            raise ValueError(f"reward num_workers={num_workers} must be >= 0; fix: use 0 to score inline")
        if timeout_s <= 0:
            raise ValueError(f"reward timeout_s={timeout_s} must be > 0; fix: e.g. 10.0 seconds")
        if num_workers > 0:
            _check_picklable(fn)
        self.fn = fn
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.default_score = float(default_score)
        self.totals = {"reward/timeouts": 0.0, "reward/errors": 0.0, "reward/invalid": 0.0}
        """Counts over all calls since the runner started."""
        methods = mp.get_all_start_methods()
        self._ctx = mp.get_context(start_method or ("forkserver" if "forkserver" in methods else "spawn"))
        self._warned: set[str] = set()
        self._closed = False
        self._workers = [self._start_worker() for _ in range(num_workers)]

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def score(self, pairs: Sequence[tuple[str, str]]) -> RewardScores:
        """Score (response_text, ground_truth) pairs; never raises for a bad reward function."""
        result = RewardScores(scores=[self.default_score] * len(pairs))
        if self.num_workers == 0:
            for i, (response_text, ground_truth) in enumerate(pairs):
                self._record(result, i, *run_one(self.fn, response_text, ground_truth))
        else:
            self._score_in_workers(pairs, result)
        for key, value in result.metrics().items():
            self.totals[key] += value
        return result

    def close(self) -> None:
        """Stop the worker processes (idempotent)."""
        for worker in self._workers:
            try:
                worker.conn.send(None)
            except (OSError, ValueError):
                pass
        for worker in self._workers:
            worker.process.join(timeout=1.0)
            worker.kill()
        self._workers = []
        self._closed = True

    # -- worker mode ---------------------------------------------------------------------------

    def _score_in_workers(self, pairs: Sequence[tuple[str, str]], result: RewardScores) -> None:
        if self._closed:
            raise RuntimeError("RewardRunner.score called after close(); fix: build a new RewardRunner")
        for k, worker in enumerate(self._workers):
            if worker.task is not None:  # left busy by an interrupted call: its result must not leak in here
                self._replace(k, reason="was busy from an interrupted call")
        pending = deque(range(len(pairs)))
        while pending or any(w.task is not None for w in self._workers):
            self._dispatch(pending, pairs)
            self._receive(result)
            self._expire(result)

    def _dispatch(self, pending: deque[int], pairs: Sequence[tuple[str, str]]) -> None:
        for k, worker in enumerate(self._workers):
            if not pending:
                return
            if worker.ready and worker.task is None:
                i = pending.popleft()
                try:
                    worker.conn.send((i, *pairs[i]))
                except (OSError, ValueError):  # died while idle: retry the sample on a new worker
                    pending.appendleft(i)
                    self._replace(k, reason="exited while idle")
                    continue
                worker.task, worker.deadline = i, time.monotonic() + self.timeout_s

    def _receive(self, result: RewardScores) -> None:
        now = time.monotonic()
        busy = [w.deadline - now for w in self._workers if w.task is not None]
        timeout = max(0.0, min([*busy, _POLL_S]))
        by_conn = {w.conn: k for k, w in enumerate(self._workers)}
        for conn in wait(list(by_conn), timeout=timeout):
            k = by_conn[conn]
            worker = self._workers[k]
            try:
                task_id, kind, payload = conn.recv()
            except (EOFError, OSError):  # the process died (e.g. a crash in native code)
                if worker.task is not None:
                    self._record(result, worker.task, "error", "reward worker process died")
                self._replace(k, reason="died")
                continue
            if task_id == "ready":
                worker.ready = True
            elif task_id == worker.task:
                self._record(result, task_id, kind, payload)
                worker.task = None

    def _expire(self, result: RewardScores) -> None:
        now = time.monotonic()
        for k, worker in enumerate(self._workers):
            if worker.task is not None and now >= worker.deadline:
                self._record(result, worker.task, "timeout", f"no result after {self.timeout_s}s")
                self._replace(k, reason="timed out")
            elif not worker.ready and now - worker.started_at > _STARTUP_TIMEOUT_S:
                self.close()
                raise RuntimeError(f"a reward worker did not start within {_STARTUP_TIMEOUT_S:.0f}s")

    def _start_worker(self) -> _Worker:
        parent_conn, child_conn = self._ctx.Pipe()
        process = self._ctx.Process(target=worker_main, args=(child_conn, self.fn), daemon=True)
        process.start()
        child_conn.close()  # the child holds its own end; closing ours makes its death an EOF here
        return _Worker(process=process, conn=parent_conn, started_at=time.monotonic())

    def _replace(self, k: int, *, reason: str) -> None:
        old = self._workers[k]
        old.kill()
        if not old.ready:
            self.close()
            raise RuntimeError(
                f"a reward worker exited before it was ready (exit code {old.process.exitcode}): the reward "
                f"function {self.fn!r} could not be loaded in a fresh process; fix: define it in an importable "
                "module (not in __main__ or a notebook), or use num_workers=0"
            )
        logger.debug("reward worker %s: replacing it", reason)
        self._workers[k] = self._start_worker()

    def _record(self, result: RewardScores, i: int, kind: str, payload: float | str | None) -> None:
        if kind == "ok":
            result.scores[i] = float(payload)
            return
        if kind == "timeout":
            result.num_timeouts += 1
        elif kind == "error":
            result.num_errors += 1
        else:
            result.num_invalid += 1
        if kind not in self._warned:  # once per kind: the metrics count the rest
            self._warned.add(kind)
            logger.warning(
                "reward function %r: %s on a sample (%s); scored %s. Later cases are only counted in reward/%s",
                self.fn,
                kind,
                payload,
                self.default_score,
                {"timeout": "timeouts", "error": "errors"}.get(kind, "invalid"),
            )


def _check_picklable(fn: Callable[[str, str], object]) -> None:
    try:
        pickle.dumps(fn)
    except Exception as e:
        raise ValueError(
            f"reward function {fn!r} cannot be sent to worker processes ({e}); fix: define it at module level "
            "(a lambda or a nested function cannot be pickled), or use num_workers=0"
        ) from e
