"""Fault injection for tests of crash recovery: `RLLOOM_FAULT=STAGE:STEP[:RANK]` kills the process
that reaches `STAGE` at `STEP` (on `RANK`, when given) with SIGKILL, as an out-of-memory kill or a
lost node would: no exception, no `finally`, no flushed buffers.

`STEP` is the number of RL steps completed when the stage is reached: `generate:2` dies in the third
step, `after_checkpoint:2` right after step 2's checkpoint. Each in-step stage fires once its work is
done (its results exist only in memory); a stage that a setting turns off (ref_logprobs without a KL
term) still fires at its place in the step.

Driver stages, in step order: generate, rewards, old_logprobs, ref_logprobs, advantages, train (all
policy updates done, weights not yet synced), sync (the step's `StageTimer` fires them as each
stage ends: `at_stage_end`); then save_engine (the engine state of the step's
checkpoint is written, the checkpoint's manifest is not) and after_checkpoint. Worker stages: update_policy
(before an optimizer step; there STEP counts optimizer steps, the policy version, and RANK picks the
training rank), save (a training rank has written its engine state into the checkpoint's temporary
folder, and the call has not returned: no manifest seals it; STEP is the policy version, RANK the
training rank) and rollout (a rollout worker's generate or stream_add call has started; STEP is the
policy version its weights hold, RANK the rollout rank). Unset in normal runs; reading one variable
costs nothing.

With `RLLOOM_FAULT_ONCE=FILE` as well, the fault fires only in the process that creates FILE (the
first to reach it): a Ray run that restarts itself (`trainer.max_restarts`) reaches the same stage,
step and rank again in a fresh actor, which then lives.

`RLLOOM_FAULT_RESEED=FILE`: a rollout worker started while FILE exists draws other noise for every
seed (`reseeds`): a replay that samples other tokens for the same seed, as a GPU's bf16 may in
another batch (for the replacement of a killed rollout actor, FILE the kill's marker).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

from rlloom.config import ConfigError

STEP_STAGES = ("generate", "rewards", "old_logprobs", "ref_logprobs", "advantages", "train", "sync")
SAVE_STAGES = ("save_engine", "after_checkpoint")
WORKER_STAGES = ("update_policy", "save", "rollout")
STAGES = STEP_STAGES + SAVE_STAGES + WORKER_STAGES
ENV = "RLLOOM_FAULT"
ONCE_ENV = "RLLOOM_FAULT_ONCE"
RESEED_ENV = "RLLOOM_FAULT_RESEED"


@dataclass(frozen=True, slots=True)
class Fault:
    stage: str
    step: int
    rank: int | None = None


@lru_cache(maxsize=8)
def parse_fault(spec: str) -> Fault | None:
    """The fault `spec` (a `RLLOOM_FAULT` value) asks for; None for an empty spec."""
    if not spec:
        return None
    parts = spec.split(":")
    numbers = parts[1:]
    if not 2 <= len(parts) <= 3 or parts[0] not in STAGES or not all(p.isdigit() for p in numbers):
        raise ConfigError(
            f"{ENV}={spec!r} is not STAGE:STEP[:RANK] with STEP and RANK integers >= 0 and STAGE one of "
            f"{', '.join(STAGES)}. Fix: e.g. {ENV}=generate:2, or unset {ENV}."
        )
    return Fault(parts[0], int(parts[1]), int(parts[2]) if len(parts) == 3 else None)


def check_fault_env() -> None:
    """Fail at start-up, with a clear message, on a `RLLOOM_FAULT` value that does not parse."""
    parse_fault(os.environ.get(ENV, ""))


def maybe_fail(stage: str, step: int, rank: int = 0) -> None:
    """Kill this process if `RLLOOM_FAULT` names this stage, step (and rank)."""
    fault = parse_fault(os.environ.get(ENV, ""))
    if fault is None:
        return
    if fault.stage == stage and fault.step == step and fault.rank in (None, rank) and _first_to_fire():
        os.kill(os.getpid(), signal.SIGKILL)


def _first_to_fire() -> bool:
    """True unless `RLLOOM_FAULT_ONCE` names a file that exists; creates it."""
    once = os.environ.get(ONCE_ENV, "")
    if not once:
        return True
    try:
        os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def at_stage_end(step: int) -> Callable[[str], None]:
    """The RL step's `StageTimer(on_end=...)` hook: `maybe_fail(stage, step)` as each of its stages
    ends. Generation scores the samples as they finish, so the end of `generate` is also `rewards`'."""

    def fire(stage: str) -> None:
        maybe_fail(stage, step)
        if stage == "generate":
            maybe_fail("rewards", step)

    return fire


def reseeds() -> bool:
    """Whether this rollout worker draws other noise for every seed (`RLLOOM_FAULT_RESEED`)."""
    marker = os.environ.get(RESEED_ENV, "")
    return bool(marker) and os.path.exists(marker)
