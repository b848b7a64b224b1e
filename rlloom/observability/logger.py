"""The metrics-logger interface every backend implements (`log`, `log_samples`, `close`), the record
of a logged completion, and the fan-out to several backends. loggers.py builds them from the config."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(kw_only=True, slots=True)
class SampleRecord:
    """One completion as logged: what was asked, what came back and how it scored."""

    step: int
    """The RL step (as in metrics.jsonl) whose rollout produced it."""
    prompt: str
    """The prompt's text: a string prompt as it is, chat messages as `role: content` lines."""
    response: str
    """The decoded response."""
    reward: float
    """The reward the update used (the reward function's score plus any shaping)."""
    ground_truth: str
    """What the reward function compared the response with."""
    finish_reason: str
    """`stop` (an end token) or `length` (rollout.max_new_tokens reached)."""
    turns: int | None = None
    """Multi-turn episodes: generation turns of the trajectory (None for single-turn runs)."""
    messages: list[dict[str, Any]] | None = None
    """Multi-turn episodes: the whole conversation as chat messages, observations included; the
    `response` is then the last assistant message."""


class Logger(ABC):
    """Receives one dict of scalar metrics per step."""

    @abstractmethod
    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record `metrics` (keys `component/quantity_unit`, float values) for RL step `step`."""

    def log_samples(self, step: int, records: Sequence[SampleRecord]) -> None:
        """Record a few sample completions of step `step` (backends without a place for them ignore them)."""
        return None

    def close(self) -> None:
        """Flush and release files or displays. Safe to call twice."""
        return None

    def __enter__(self) -> Logger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MultiLogger(Logger):
    """Sends every call to each of its loggers, in order."""

    def __init__(self, loggers: Sequence[Logger]) -> None:
        self.loggers = list(loggers)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for logger in self.loggers:
            logger.log(step, metrics)

    def log_samples(self, step: int, records: Sequence[SampleRecord]) -> None:
        for logger in self.loggers:
            logger.log_samples(step, records)

    def close(self) -> None:
        # Close every backend even if one fails, then re-raise the first failure.
        first_error: BaseException | None = None
        for logger in self.loggers:
            try:
                logger.close()
            except Exception as error:
                first_error = first_error or error
        if first_error is not None:
            raise first_error
