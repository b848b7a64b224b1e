"""Run checkpoints: engine state + trainer state (step, data position) + config, sealed and swapped in whole.

Layout: RUN_DIR/checkpoints/step_000004/{engine/, trainer_state.json, config.yaml, manifest.json},
and `critic/` with PPO's critic. `engine/` and `critic/` are the engines' own sealed folders; the
run's manifest (written last) hashes the other files and their `manifest.json` (see `rlloom.engines.train.sealed`). A checkpoint is built in
`step_N.tmp-PID` and swapped in only when complete, so a kill or a full disk at any moment leaves
every earlier checkpoint intact. At start-up (under the run lock) `prepare_run_dir` deletes
interrupted saves, and `resolve_resume` refuses to overwrite a run with `resume=never` and, with
`resume=auto`, takes the newest checkpoint that verifies, saying which damaged ones it skipped.

With `trainer.save_weights_only`, `engine/` is replaced by `hf/`: the policy as a Hugging Face folder
(the model's dtype, no optimizer, schedule or RNG state). So is the checkpoint a run writes when it
ends normally with `trainer.save_every: 0` (`final_is_weights_only`): a resume needs the optimizer
state only to continue a run that stopped early (Ctrl-C, SIGTERM, a crash: those checkpoints are
full), and a run that reached `trainer.total_steps` continues only when total_steps is raised,
which a run meant to be extended asks for with `trainer.save_every: K` (every checkpoint full, the
last one too). No run resumes from a weights-only checkpoint (`resolve_resume` refuses it, naming
the way to start a new run from its weights); `rlloom export` and `rlloom eval` read it like any other.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlloom.cluster.base import CriticGroup, TrainGroup, WeightSync
from rlloom.config import ConfigError, RunConfig
from rlloom.config.loading import to_yaml
from rlloom.engines.train.build import read_model_tensors
from rlloom.engines.train.sealed import (
    MANIFEST,
    CheckpointError,
    recover_parent,
    swap_in,
    verify_folder,
    write_manifest,
)
from rlloom.faults import maybe_fail
from rlloom.models.checkpoint import from_pretrained
from rlloom.observability.loggers import LOG_NAMES
from rlloom.run_files import free_space, fresh_dir, make_dir, refuse_link, write_text

log = logging.getLogger(__name__)
ENGINE_DIR = "engine"
CRITIC_DIR = "critic"
"""PPO's critic (algorithm.estimator=gae): its engine's sealed folder, beside the policy's."""
WEIGHTS_DIR = "hf"
"""The Hugging Face folder that replaces ENGINE_DIR in a weights-only checkpoint."""
CHECKPOINTS_DIR = "checkpoints"
CONFIG_FILE = "config.yaml"
"""The resolved config, in RUN_DIR (trainer/run.py) and in each checkpoint."""
HF_DIR = "hf"
"""RUN_DIR/hf/step_N: the run's Hugging Face folders (trainer/export.py)."""
STEP_NAMES = r"step_\d+"
"""Names of the folders under CHECKPOINTS_DIR and HF_DIR (step_000004)."""


@dataclass(kw_only=True, slots=True)
class TrainerState:
    """What the loop needs besides the engines to continue exactly."""

    step: int
    """Steps completed."""
    data_state: dict[str, Any]
    """The prompt source's position (epoch, cursor, ...)."""
    accuracy_before: float | None = None
    """Greedy eval accuracy of the initial policy (for the final report)."""
    kl_coef: float | None = None
    """The adaptive KL controller's coefficient after this step (algorithm.kl_ctrl=adaptive), else None."""


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR / f"step_{step:06d}"


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Checkpoint folders of a run that have a manifest (not yet hash-checked), oldest step first."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    done = [  # a link is never taken for a checkpoint (resumed from, or deleted by the pruning)
        p
        for p in root.glob("step_*")
        if p.name[5:].isdigit() and not p.is_symlink() and p.is_dir() and (p / MANIFEST).is_file()
    ]
    return sorted(done, key=lambda p: int(p.name[5:]))


def final_is_weights_only(cfg: RunConfig) -> bool:
    """The checkpoint of a run that ends normally holds the weights only: always with
    trainer.save_weights_only, and with trainer.save_every=0 unless the run trains a critic (whose
    engine state `rlloom export --critic` reads: it has no weights-only form)."""
    return cfg.trainer.save_weights_only or (cfg.trainer.save_every == 0 and not cfg.algorithm.uses_critic)


def save_checkpoint(
    train_group: TrainGroup,
    cfg: RunConfig,
    state: TrainerState,
    *,
    weights_only: bool,
    critic_group: CriticGroup | None = None,
) -> Path:
    """Write a complete checkpoint for `state.step` (`weights_only`: the policy as a Hugging Face
    folder; else the engines' full state, with the critic's when there is one), drop the ones beyond
    `keep_last_checkpoints`, and return its folder. On failure (e.g. a full disk) nothing of it
    remains and CheckpointError names the checkpoint to resume from."""
    final = checkpoint_dir(cfg.trainer.run_dir, state.step)
    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    try:
        make_dir(final.parent)
        fresh_dir(tmp)
        sealed = []
        if weights_only:
            train_group.save_hf(str(tmp / WEIGHTS_DIR)).result()
        else:
            train_group.save(str(tmp / ENGINE_DIR)).result()
            sealed.append(ENGINE_DIR)
            if critic_group is not None:
                critic_group.save(str(tmp / CRITIC_DIR)).result()
                sealed.append(CRITIC_DIR)
        maybe_fail("save_engine", state.step)
        trainer_state = {
            "step": state.step,
            "data_state": state.data_state,
            "accuracy_before": state.accuracy_before,
            "kl_coef": state.kl_coef,
        }
        write_text(tmp / "trainer_state.json", json.dumps(trainer_state))
        write_text(tmp / CONFIG_FILE, to_yaml(cfg))
        write_manifest(tmp, sealed=sealed)
        swap_in(tmp, final)
    except (OSError, CheckpointError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        reason = (
            e.__cause__ if isinstance(e, CheckpointError) and e.__cause__ else e
        )  # the engine's bare cause
        previous = [p.name for p in complete_checkpoints(cfg.trainer.run_dir)]
        kept = (
            f"the newest earlier checkpoint, {previous[-1]}, is intact"
            if previous
            else "no earlier checkpoint exists"
        )
        raise CheckpointError(
            f"the checkpoint of step {state.step} was not saved ({reason}; {free_space(final.parent)} free on its "
            "disk); its temporary folder was removed and "
            f"{kept}. Fix: free disk space or set trainer.keep_last_checkpoints lower, then rerun with "
            "trainer.resume=auto."
        ) from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    prune_checkpoints(cfg.trainer.run_dir, cfg.trainer.keep_last_checkpoints, keep=final)
    return final


def prune_checkpoints(run_dir: str | Path, keep_last: int, *, keep: Path) -> None:
    """Delete complete checkpoints but `keep` and the newest `keep_last - 1` others (0 keeps all)."""
    if keep_last <= 0:
        return
    others = [p for p in complete_checkpoints(run_dir) if p != keep]
    for old in others[: max(len(others) - (keep_last - 1), 0)]:
        shutil.rmtree(old)
        log.info("deleted checkpoint %s (trainer.keep_last_checkpoints=%d)", old, keep_last)


def prepare_run_dir(run_dir: str | Path) -> None:
    """Refuse links where the run writes its folders (before any step is trained), delete interrupted
    saves and finish interrupted swaps (call under the run lock)."""
    for name in (CHECKPOINTS_DIR, HF_DIR, CONFIG_FILE, *LOG_NAMES):
        refuse_link(Path(run_dir) / name)
    for action in recover_parent(Path(run_dir) / CHECKPOINTS_DIR, STEP_NAMES):
        log.info("checkpoints: %s", action)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest checkpoint of a run folder whose files all match their manifest, or None.

    Damaged or tampered checkpoints are skipped with a warning naming the file."""
    for path in reversed(complete_checkpoints(run_dir)):
        try:
            verify_folder(path)
        except CheckpointError as e:
            log.warning("skipping checkpoint %s and falling back to an earlier one: %s", path.name, e)
            continue
        return path
    return None


def _holds_run(run_dir: Path) -> str | None:
    if (run_dir / "metrics.jsonl").is_file():
        return "metrics.jsonl"
    ckpts = run_dir / "checkpoints"
    if ckpts.is_dir() and any(ckpts.iterdir()):
        return "checkpoints/"
    return None


def resolve_resume(cfg: RunConfig) -> Path | None:
    """The checkpoint `trainer.resume` asks for (None = start fresh); refuses to overwrite a run."""
    path = _resume_checkpoint(cfg)
    if path is not None and is_weights_only(path):
        raise ConfigError(
            f"trainer.resume={cfg.trainer.resume!r} found {str(path)!r}, a weights-only checkpoint "
            "(trainer.save_weights_only=true, or the end of a run with trainer.save_every=0): it has no optimizer, "
            "schedule or RNG state, so the run cannot continue from it exactly. Fix: start a new run from its "
            f"weights with model.path={path / WEIGHTS_DIR} and another trainer.run_dir, or resume from a full "
            "checkpoint (a run given trainer.save_every=K > 0 writes only full ones, its last one too)."
        )
    return path


def is_weights_only(checkpoint: str | Path) -> bool:
    """The checkpoint holds the policy's weights only (`trainer.save_weights_only`)."""
    return (Path(checkpoint) / WEIGHTS_DIR).is_dir() and not (Path(checkpoint) / ENGINE_DIR).is_dir()


def _resume_checkpoint(cfg: RunConfig) -> Path | None:
    resume, run_dir = cfg.trainer.resume, Path(cfg.trainer.run_dir)
    if resume == "never":
        found = _holds_run(run_dir)
        if found:
            raise ConfigError(
                f"trainer.resume=never but trainer.run_dir={str(run_dir)!r} already holds a run ({found}); "
                "starting over would overwrite it. Fix: continue it with trainer.resume=auto, choose another "
                "trainer.run_dir, or delete the folder to start over."
            )
        return None
    if resume == "auto":
        latest = latest_checkpoint(run_dir)
        if latest is None and complete_checkpoints(run_dir):
            raise ConfigError(
                f"trainer.resume=auto found no intact checkpoint in {str(run_dir / 'checkpoints')!r} (every one "
                "is damaged; see the warnings above). Fix: restore a checkpoint, or start over in another "
                "trainer.run_dir."
            )
        return latest
    path = Path(resume)
    try:
        verify_folder(path)
    except CheckpointError as e:
        raise ConfigError(
            f"trainer.resume={resume!r} is not a complete checkpoint (it must be an intact "
            f"RUN_DIR/checkpoints/step_N, or use trainer.resume=auto): {e}"
        ) from e
    return path


def load_checkpoint(
    train_group: TrainGroup,
    weight_sync: WeightSync | None,
    path: Path,
    *,
    critic_group: CriticGroup | None = None,
) -> TrainerState:
    """Restore the training engines (and the critic's) from `path`, sync the restored weights and
    version into the rollout group (the same sync as after a step; `rlloom sft` has no rollout and
    passes no `weight_sync`), and return the trainer state saved with them. The reference model is
    not touched: it stays the initial policy, as in the uninterrupted run."""
    raw = json.loads((path / "trainer_state.json").read_text())
    if critic_group is not None and not (path / CRITIC_DIR).is_dir():
        raise ConfigError(
            f"algorithm.estimator=gae trains a critic, but the checkpoint {str(path)!r} holds none (its run had "
            "another estimator). Fix: resume with that run's algorithm.estimator, or start a new run from its "
            f"weights (model.path={path / WEIGHTS_DIR} after `rlloom export`)."
        )
    train_group.load(str(path / ENGINE_DIR)).result()
    if critic_group is not None:
        critic_group.load(str(path / CRITIC_DIR)).result()
    if weight_sync is not None:
        weight_sync.sync()
    return TrainerState(
        step=raw["step"],
        data_state=raw["data_state"],
        accuracy_before=raw.get("accuracy_before"),
        kl_coef=raw.get("kl_coef"),
    )


def checkpoint_model_tensors(path: str | Path) -> dict[str, Any]:
    """The full model weights of a run checkpoint `RUN_DIR/checkpoints/step_N` (verified), on CPU,
    under the native CausalLM's `state_dict` names (see `read_model_tensors`); a weights-only
    checkpoint's are read from its Hugging Face folder (in the model's dtype, as fp32)."""
    verify_folder(path)
    if is_weights_only(path):
        return from_pretrained(Path(path) / WEIGHTS_DIR, dtype=torch.float32).state_dict()
    return read_model_tensors(Path(path) / ENGINE_DIR)


def folder_gb(path: Path) -> float:
    """The size of a folder's files in GB (2**30 bytes), e.g. a checkpoint's for the run's summary."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**30
