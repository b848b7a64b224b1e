"""Wall-clock timing of the RL loop's stages, reported as `time/<stage>_s` metrics.

    timer = StageTimer()
    with timer("generate"):
        completions = rollout.generate(requests, sampling)
    with timer("train"):
        train_metrics = engine.train_step(batch, loss_fn)
    logger.log(step, timer.seconds())    # {"time/generate_s": 3.1, "time/train_s": 5.4}
    timer.reset()

`on_end(stage)`, when given, is called as each stage's body finishes without an error: the RL step
fires its fault-injection points there (rlloom/faults.py), at the end of the stage they name.

CUDA kernels run asynchronously, so without a synchronize a stage would be charged only for the
time to enqueue its kernels and the next stage for the rest. With `sync_cuda` (the default when a
CUDA device is in use) the timer synchronizes the current device when a stage starts and ends.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from rlloom.observability.metrics import Max


class StageTimer:
    """Collects seconds per stage; entering the same stage twice in one step adds up."""

    def __init__(self, sync_cuda: bool | None = None, *, on_end: Callable[[str], None] | None = None) -> None:
        """`sync_cuda=None` synchronizes only when CUDA is available and already initialised."""
        self._sync_cuda = sync_cuda
        self._on_end = on_end
        self._seconds: dict[str, float] = {}

    def _sync(self) -> None:
        sync = self._sync_cuda
        if sync is None:
            # Do not initialise CUDA just to time a CPU run.
            sync = torch.cuda.is_available() and torch.cuda.is_initialized()
        if sync:
            torch.cuda.synchronize()

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        """Time the body of a `with` block as stage `stage` (a short snake_case name)."""
        if not stage or "/" in stage or any(c.isspace() for c in stage):
            raise ValueError(
                f"stage name {stage!r} is invalid: it becomes the key time/<stage>_s, so it must be a "
                "non-empty name without '/' or spaces. Fix: use e.g. 'generate' or 'ref_logprobs'."
            )
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            key = f"time/{stage}_s"
            self._seconds[key] = self._seconds.get(key, 0.0) + time.perf_counter() - start
        if self._on_end is not None:
            self._on_end(stage)

    def seconds(self) -> dict[str, float]:
        """`{"time/<stage>_s": seconds}` for every stage timed since the last reset."""
        return dict(self._seconds)

    def metrics(self) -> dict[str, Max]:
        """The same as `seconds()`, as `Max` metrics: across ranks a step waits for the slowest one."""
        return {key: Max(value) for key, value in self._seconds.items()}

    def reset(self) -> None:
        """Start a new step."""
        self._seconds.clear()
