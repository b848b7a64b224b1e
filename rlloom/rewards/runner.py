"""`RewardRunner`: scores (response, ground truth) pairs so that no reward function can stall or kill
the training loop.

With `num_workers >= 1` (what `build_reward_runner` gives every plug-in) samples are scored in a pool
of worker processes (`rlloom.rewards.process`) that live across calls until `close()`:
- each sample has a deadline of `timeout_s`; a worker that misses it is killed with every process
  it started (a daemon that left its session too: `rlloom.rewards.process_tree`) and replaced, so a
  call returns at most about `timeout_s` after its last sample started; `close()` ends them all the
  same way, so nothing a reward started outlives the run;
- what a worker prints goes to the trainer's stderr through a pipe of the worker's own;
- a worker whose process dies (`os._exit`, a segfault, the memory cap) is replaced the same way;
- `memory_limit_gb` caps each worker's address space (an allocation beyond it fails in the worker).
Samples go to the workers in chunks of up to `_MAX_CHUNK` and come back one by one, so a worker is
never idle waiting for its next sample; a chunk's samples after a hung one are sent again. A
batched function (`rlloom.rewards.calling`) gets chunks of up to `_MAX_BATCH` samples in one call;
`timeout_s` then bounds the call, and a call that misses it fails all of its samples.

With `num_workers=0` the function runs inline in this process: only for the trusted built-ins,
which are much cheaper inline (see `build_reward_runner`); there is no timeout then.

A sample whose function hangs, raises (or calls `sys.exit`), crashes its process, or returns None /
NaN / inf / a number beyond +-1e15 (`calling.MAX_ABS_SCORE`) / something that is not a number gets
`default_score`, and is counted in the metrics `reward/timeouts`, `reward/errors` and
`reward/invalid`. Scores come back in input order.

A reward model (`model`, e.g. `rlloom.rewards.reward_model.RewardModel`; the `model` term of
reward.name) always runs in this process, after the function: a sample's score is the function's
(0 without one) plus `model_weight` x the model's score of its conversation. A sample whose function
failed keeps `default_score`; a model call that raises fails every sample of the call (an error), a
non-finite model score fails its sample (invalid).
"""

from __future__ import annotations

import logging
import math
import pickle
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import wait

from rlloom.rewards.calling import MAX_ABS_SCORE, RewardInput, is_batched, score_items
from rlloom.rewards.process import WorkerProcess

logger = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 120.0  # a worker not ready by then is broken (e.g. an import that hangs)
_POLL_S = 0.5  # longest single wait, so startup problems are noticed while nothing is busy
_MAX_CHUNK = 16  # samples sent to a worker at once: fewer round trips, still balanced
_MAX_BATCH = 64  # samples per call of a batched function (reward models)


@dataclass(kw_only=True, slots=True)
class RewardScores:
    """The scores of one call, in input order, with the failures counted."""

    scores: list[float]
    model_scores: list[float] | None = None
    """The reward model's score of each sample (before its weight), when the runner has one; the
    samples the model failed on hold NaN."""
    num_timeouts: int = 0
    num_errors: int = 0
    num_invalid: int = 0
    failed: set[int] = field(default_factory=set)
    """Positions of the samples that got `default_score` (timed out, raised, invalid)."""

    def metrics(self) -> dict[str, float]:
        return {
            "reward/timeouts": float(self.num_timeouts),
            "reward/errors": float(self.num_errors),
            "reward/invalid": float(self.num_invalid),
        }


class RewardRunner:
    """Scores responses with a reward function, inline or in worker processes with timeouts.

    Example: `with RewardRunner(get_reward_fn("my_rewards:judge"), num_workers=2, timeout_s=5.0) as
    runner: result = runner.score([("12 + 35 = 47", "47")])` -> `result.scores == [1.0]`.
    """

    def __init__(
        self,
        fn: Callable[..., object] | None,
        *,
        num_workers: int = 0,
        timeout_s: float = 10.0,
        default_score: float = 0.0,
        memory_limit_gb: float = 0.0,
        model: Callable[[list[str]], list[float]] | None = None,
        model_weight: float = 1.0,
    ) -> None:
        """`fn` None: the reward model alone scores (then `model` is needed)."""
        if fn is None and model is None:
            raise ValueError("a RewardRunner needs a reward function, a reward model, or both")
        if num_workers < 0:
            raise ValueError(f"reward num_workers={num_workers} must be >= 0; fix: use 0 to score inline")
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"reward timeout_s={timeout_s} must be finite and > 0; fix: e.g. 10.0 seconds")
        if not (math.isfinite(memory_limit_gb) and memory_limit_gb >= 0):
            raise ValueError(
                f"reward memory_limit_gb={memory_limit_gb} must be >= 0; fix: e.g. 4 (0: no cap)"
            )
        self.fn = fn
        self.model, self.model_weight = model, model_weight
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.default_score = float(default_score)
        self.batched = fn is not None and is_batched(fn)
        """True for a batched function (`rlloom.rewards.calling`): `timeout_s` then bounds each call."""
        self.totals = {"reward/timeouts": 0.0, "reward/errors": 0.0, "reward/invalid": 0.0}
        """Counts over all calls since the runner started."""
        self._pickled_fn = _pickle_fn(fn) if num_workers > 0 else b""
        self._memory_limit_bytes = int(memory_limit_gb * 2**30)
        self._warned: set[str] = set()
        self._closed = False
        self._workers = [self._start_worker() for _ in range(num_workers)]

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def score(self, samples: Sequence[RewardInput | tuple[str, str]]) -> RewardScores:
        """Score samples (a `(response_text, ground_truth)` pair is a sample without prompt or
        columns); never raises for a bad reward function."""
        items = [s if isinstance(s, RewardInput) else RewardInput(*s) for s in samples]
        result = RewardScores(scores=[self.default_score] * len(items))
        if self.fn is None:
            result.scores = [0.0] * len(items)
        elif self.num_workers == 0:
            for i, (kind, payload) in enumerate(score_items(self.fn, items)):
                self._record(result, i, kind, payload)
        else:
            self._score_in_workers(items, result)
        if self.model is not None:
            self._add_model_scores(items, result)
        for key, value in result.metrics().items():
            self.totals[key] += value
        return result

    def _add_model_scores(self, items: list[RewardInput], result: RewardScores) -> None:
        """Add `model_weight` x the reward model's score of each conversation to the samples the
        function scored (`_record` leaves a failed one at `default_score`, and it stays there)."""
        try:
            scores = [float(v) for v in self.model([item.conversation for item in items])]  # type: ignore[misc]
            problem = None if len(scores) == len(items) else f"{len(scores)} scores for {len(items)} texts"
        except Exception as e:  # noqa: BLE001  a bad batch fails its samples, not the run (counted)
            scores, problem = [math.nan] * len(items), f"{type(e).__name__}: {e}"[:500]
        if problem is not None:
            scores = [math.nan] * len(items)
        result.model_scores = scores
        for i, score in enumerate(scores):
            if i in result.failed:
                continue
            if problem is not None or not math.isfinite(score) or abs(score) > MAX_ABS_SCORE:
                self._record(result, i, "error" if problem else "invalid", problem or repr(score))
                scores[i] = math.nan
            else:
                result.scores[i] += self.model_weight * score

    def close(self) -> None:
        """Kill the worker processes and everything they started (idempotent): a worker left to exit
        on its own would leave its daemons to init."""
        for worker in self._workers:
            worker.kill()
        self._workers = []
        self._closed = True

    # -- worker mode ---------------------------------------------------------------------------

    def _score_in_workers(self, items: list[RewardInput], result: RewardScores) -> None:
        if self._closed:
            raise RuntimeError("RewardRunner.score called after close(); fix: build a new RewardRunner")
        for k, worker in enumerate(self._workers):
            if worker.tasks:  # left busy by an interrupted call: its results must not leak in here
                self._replace(k, reason="was busy from an interrupted call")
        pending = deque(range(len(items)))
        while pending or any(w.tasks for w in self._workers):
            self._dispatch(pending, items)
            self._receive(result, pending)
            self._expire(result, pending)

    def _dispatch(self, pending: deque[int], items: list[RewardInput]) -> None:
        for k, worker in enumerate(self._workers):
            if not pending:
                return
            if worker.ready and not worker.tasks:
                size = min(_MAX_BATCH if self.batched else _MAX_CHUNK, -(-len(pending) // self.num_workers))
                chunk = [pending.popleft() for _ in range(size)]
                try:
                    worker.send([(i, items[i]) for i in chunk], timeout_s=self.timeout_s)
                except (OSError, ValueError):  # died while idle: its samples go to a new worker
                    pending.extendleft(reversed(chunk))
                    worker.tasks.clear()
                    self._replace(k, reason="exited while idle")

    def _receive(self, result: RewardScores, pending: deque[int]) -> None:
        now = time.monotonic()
        busy = [w.deadline - now for w in self._workers if w.tasks]
        by_conn = {w.conn: k for k, w in enumerate(self._workers)}
        for conn in wait(list(by_conn), timeout=max(0.0, min([*busy, _POLL_S]))):
            k = by_conn[conn]
            worker = self._workers[k]
            try:
                while conn.poll():
                    self._on_message(worker, result, conn.recv())
            except (EOFError, OSError):  # the process died (os._exit, a crash in native code, killed)
                self._fail_first(worker, result, pending, "error", "the reward worker process died")
                self._replace(k, reason="died")

    def _on_message(self, worker: WorkerProcess, result: RewardScores, message: object) -> None:
        if isinstance(message, tuple) and message[0] == "ready":
            worker.ready = True
        elif isinstance(message, tuple) and message[0] == "load_error":
            self.close()
            raise RuntimeError(
                f"the reward function {self.fn!r} cannot be loaded in a worker process ({message[1]}); fix: "
                "define it in a module importable from the trainer (not in __main__ or a notebook), or raise "
                "reward.memory_limit_gb (0: no cap) if the cap got in the way"
            )
        else:
            for task_id, kind, payload in message:  # type: ignore[attr-defined]
                if worker.tasks and task_id == worker.tasks[0]:
                    worker.tasks.popleft()
                    worker.deadline = time.monotonic() + self.timeout_s
                    self._record(result, task_id, kind, payload)

    def _expire(self, result: RewardScores, pending: deque[int]) -> None:
        now = time.monotonic()
        for k, worker in enumerate(self._workers):
            if worker.tasks and now >= worker.deadline:
                self._fail_first(worker, result, pending, "timeout", f"no result after {self.timeout_s}s")
                self._replace(k, reason="timed out")
            elif not worker.ready and now - worker.started_at > _STARTUP_TIMEOUT_S:
                self.close()
                raise RuntimeError(
                    f"a reward worker did not start within {_STARTUP_TIMEOUT_S:.0f}s; fix: make the module of "
                    f"{self.fn!r} import faster (load models lazily, on the first call)"
                )

    def _fail_first(
        self, worker: WorkerProcess, result: RewardScores, pending: deque[int], kind: str, why: str
    ) -> None:
        """The sample being scored fails with `kind` (for a batched function: the whole call's samples);
        the rest of the chunk is scored again elsewhere."""
        failed = list(worker.tasks) if self.batched else list(worker.tasks)[:1]
        for task_id in failed:
            self._record(result, task_id, kind, why)
        pending.extendleft(reversed([t for t in worker.tasks if t not in failed]))
        worker.tasks.clear()

    def _start_worker(self) -> WorkerProcess:
        return WorkerProcess.start(self._pickled_fn, memory_limit_bytes=self._memory_limit_bytes)

    def _replace(self, k: int, *, reason: str) -> None:
        old = self._workers[k]
        old.kill()
        if not old.ready:
            self.close()
            raise RuntimeError(
                f"a reward worker exited before it was ready (exit code {old.popen.returncode}): the reward "
                f"function {self.fn!r} could not be loaded in a fresh process; fix: define it in an importable "
                "module (not in __main__ or a notebook), or raise reward.memory_limit_gb"
            )
        logger.debug("reward worker %s: replacing it", reason)
        self._workers[k] = self._start_worker()

    def _record(self, result: RewardScores, i: int, kind: str, payload: float | str | None) -> None:
        if kind == "ok":
            result.scores[i] = float(payload)
            return
        result.scores[i] = self.default_score
        result.failed.add(i)
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


def _pickle_fn(fn: Callable[..., object]) -> bytes:
    try:
        return pickle.dumps(fn)
    except Exception as e:
        raise ValueError(
            f"reward function {fn!r} cannot be sent to worker processes ({e}); fix: define it at module level "
            "(a lambda or a nested function cannot be pickled)"
        ) from e
