"""`run_steps`: the step loop that `rlloom train` (trainer/run.py) and `rlloom sft` (trainer/sft.py)
share, around a step function each passes.

[step -> freeze the heap after the first -> peak memory -> the caller's metrics -> log -> checkpoint
every k -> Hugging Face folder every k] until trainer.total_steps; a Ctrl-C or SIGTERM during a step
finishes it, writes its checkpoint (the one due, or one now) and raises `RunStopped`. The checkpoint
holds the engines' state, the prompt source's position and `TrainerState`, so that a resume trains
exactly the steps an uninterrupted run would have (trainer/checkpoint.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rlloom.cluster.base import TrainGroup
from rlloom.config import RunConfig
from rlloom.data.source import PromptSource
from rlloom.devices import resolve_device
from rlloom.faults import maybe_fail
from rlloom.observability.loggers import MultiLogger
from rlloom.observability.memory import peak_memory_gib
from rlloom.trainer.checkpoint import WEIGHTS_DIR, TrainerState, final_is_weights_only, save_checkpoint
from rlloom.trainer.export import link_run_hf, save_run_hf
from rlloom.trainer.stop import RunStopped, StopSignals

StepFn = Callable[[int, StopSignals], dict[str, float]]
"""One step after `step` steps done (the stop signals: an asynchronous loop checks them itself):
its metrics."""


def _nothing(*_: object) -> None:
    return None


@dataclass(frozen=True, slots=True)
class StepHooks:
    """What a loop does around its steps beyond the shared ones (RL: evaluation, samples, the stall
    check, the asynchronous loop's drain; SFT: the loss kept for the summary)."""

    freeze_heap: Callable[[], None]
    """After the first step: the warm-up built what stays, so later collections skip it."""
    add_metrics: Callable[[int, dict[str, float], bool], None] = _nothing
    """(step, its metrics, is_last) before they are logged: what the step adds to them."""
    after_log: Callable[[int, bool], None] = _nothing
    """(step, is_last) after its metrics are logged, before its checkpoint."""
    drain: Callable[[int], None] = _nothing
    """(step) before the checkpoint of a run stopped by a signal."""


@dataclass(frozen=True, slots=True)
class LoopParts:
    """The pieces of a run the loop steps and checkpoints."""

    cfg: RunConfig
    state: TrainerState
    """Advanced in place: its `step` is the steps done."""
    train: TrainGroup
    source: PromptSource
    loggers: MultiLogger
    critic: TrainGroup | None = None


def run_steps(parts: LoopParts, step: StepFn, hooks: StepHooks) -> Path | None:
    """Steps from `parts.state.step` to trainer.total_steps; the last checkpoint written (None: none)."""
    cfg, state = parts.cfg, parts.state

    def checkpoint(weights_only: bool) -> Path:  # of the step just done
        state.data_state = parts.source.state_dict()
        path = save_checkpoint(parts.train, cfg, state, weights_only=weights_only, critic_group=parts.critic)
        maybe_fail("after_checkpoint", state.step)
        return path

    saved: Path | None = None
    first_step = state.step + 1
    with StopSignals() as stop:  # Ctrl-C / SIGTERM: finish the step, checkpoint, RunStopped
        while state.step < cfg.trainer.total_steps:
            metrics = step(state.step, stop)
            state.step += 1
            if state.step == first_step:
                hooks.freeze_heap()
            metrics["memory/peak_gib"] = peak_memory_gib(resolve_device(cfg).type)
            is_last = state.step == cfg.trainer.total_steps
            hooks.add_metrics(state.step, metrics, is_last)
            parts.loggers.log(state.step, metrics)
            hooks.after_log(state.step, is_last)
            saved = save_step(cfg, parts.train, state.step, is_last, checkpoint)
            if stop.signum and not is_last:  # a Ctrl-C or SIGTERM arrived during this step
                hooks.drain(state.step)
                raise RunStopped(stop.signum, state.step, saved or checkpoint(cfg.trainer.save_weights_only))
    return saved


def save_step(
    cfg: RunConfig, train: TrainGroup, step: int, is_last: bool, checkpoint: Callable[[bool], Path]
) -> Path | None:
    """The checkpoint and Hugging Face folder due after `step`; the checkpoint written, if any."""
    weights_only = cfg.trainer.save_weights_only or (is_last and final_is_weights_only(cfg))
    saved = checkpoint(weights_only) if due(cfg.trainer.save_every, step, is_last) else None
    if _hf_due(cfg, step, is_last) and saved is not None and (saved / WEIGHTS_DIR).is_dir():
        link_run_hf(saved / WEIGHTS_DIR, cfg, step)  # the same files: no second copy
    elif _hf_due(cfg, step, is_last):
        save_run_hf(train, cfg, step)
    return saved


def due(every: int, step: int, is_last: bool) -> bool:
    """Something done every `every` steps (0: at the end only) is due after `step`."""
    return is_last or (every > 0 and step % every == 0)


def _hf_due(cfg: RunConfig, step: int, is_last: bool) -> bool:
    every = cfg.trainer.save_hf_every
    return every >= 0 and due(every, step, is_last)  # -1: never
