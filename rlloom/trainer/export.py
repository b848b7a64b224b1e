"""Get the trained model out: Hugging Face folders from a run, during it or afterwards.

- During a run (`trainer.save_hf_every`, and always at the end): the live training engine writes
  RUN_DIR/hf/step_000004/ (config.json, tokenizer files, model.safetensors in the starting model's
  own dtype), next to RUN_DIR/checkpoints/step_000004/.
- Afterwards, `rlloom export RUN_DIR_OR_CHECKPOINT OUT` (`export_checkpoint`): the training engine
  is built on CPU from the checkpoint's own config.yaml, restored with its public `load` (so this
  code never reads checkpoint files itself and any checkpoint format or training layout works),
  and written by `rlloom.engines.train.hf_folder.save_hf_folder`. `--critic` writes the critic of
  a PPO run instead, as a value model (transformers' *ForTokenClassification with one label).

A policy's folder (both kinds) also holds `rlloom_task.yaml` (`TASK_FILE`): the run's task settings
(`TASK_SETTINGS`: chat template use, system prompt, prompt and answer columns, prompt and response
lengths, evaluation temperature, and the reward section with its name resolved), a partial config
that `rlloom eval FOLDER DATA` starts from, so the exported model is scored as its run scored it.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

import yaml

from rlloom.cluster.base import TrainGroup
from rlloom.config import ConfigError, RunConfig
from rlloom.config.loading import load_config, to_dict
from rlloom.engines.train.base import TrainEngine
from rlloom.engines.train.build import build_offline
from rlloom.engines.train.hf_folder import ExportDType, save_hf_folder
from rlloom.engines.train.sealed import verify_folder
from rlloom.run_files import fresh_dir, make_dir, write_failed, write_text
from rlloom.tasks.build import default_reward_name
from rlloom.trainer.checkpoint import (
    CRITIC_DIR,
    ENGINE_DIR,
    HF_DIR,
    WEIGHTS_DIR,
    complete_checkpoints,
    is_weights_only,
    latest_checkpoint,
)
from rlloom.trainer.model_folder import check_model_folder

logger = logging.getLogger(__name__)
_WHERE = "a run folder (RUN_DIR) or one of its checkpoints (RUN_DIR/checkpoints/step_N)"


TASK_FILE = "rlloom_task.yaml"
TASK_SETTINGS: dict[str, tuple[str, ...]] = {
    "data": ("chat_template", "system_prompt", "prompt_key", "answer_key", "max_prompt_length"),
    "rollout": ("max_new_tokens", "eval_temperature"),
}
"""The settings besides the reward section (all of it) that decide how a prompt is asked and an
answer scored; the dataset itself (data.task, data.path) is the one `rlloom eval` is given."""


def write_task_file(cfg: RunConfig, folder: Path) -> Path:
    """Write the run's task settings (`TASK_SETTINGS` and the reward) as `folder/rlloom_task.yaml`."""
    full = to_dict(cfg)
    task: dict[str, dict] = {
        section: {k: full[section][k] for k in keys} for section, keys in TASK_SETTINGS.items()
    }
    task["reward"] = full["reward"] | {"name": cfg.reward.name or default_reward_name(cfg.data.task)}
    header = (
        f"# The task settings of the run that trained this model ({cfg.trainer.run_dir}). `rlloom eval "
        "THIS_FOLDER DATA` starts from them; dotted overrides still apply last.\n"
    )
    path = folder / TASK_FILE
    write_text(path, header + yaml.safe_dump(task, sort_keys=False, default_flow_style=False))
    return path


def hf_dir(run_dir: str | os.PathLike, step: int) -> Path:
    """Where a run writes its Hugging Face folder for `step`."""
    return Path(run_dir) / HF_DIR / f"step_{step:06d}"


def save_run_hf(train_group: TrainGroup, cfg: RunConfig, step: int) -> Path:
    """Write the live policy of a run as RUN_DIR/hf/step_N (every rank takes part; the run saves its
    checkpoint first, so a write that fails, e.g. on a full disk, loses nothing: one error line says so)."""
    path = hf_dir(cfg.trainer.run_dir, step)
    start = time.perf_counter()
    try:
        make_dir(path.parent)
        train_group.save_hf(str(path)).result()
        write_task_file(cfg, path)
    except OSError as e:
        if not path.is_symlink():  # what this call wrote (the engine removes its own partial save)
            shutil.rmtree(path, ignore_errors=True)
        raise _hf_write_failed(cfg, path, e) from e
    logger.info("wrote the Hugging Face folder %s (%.1f s)", path, time.perf_counter() - start)
    return path


def link_run_hf(weights: Path, cfg: RunConfig, step: int) -> Path:
    """RUN_DIR/hf/step_N as hard links to the files of a weights-only checkpoint's Hugging Face folder
    `weights` (the same bytes: the disk holds the weights once; a copy where links are not possible)."""
    path = hf_dir(cfg.trainer.run_dir, step)
    try:
        make_dir(path.parent)
        fresh_dir(path)
        for file in weights.iterdir():
            try:
                os.link(file, path / file.name)
            except OSError:  # another file system, or one without hard links
                shutil.copy2(file, path / file.name)
        write_task_file(cfg, path)
    except OSError as e:
        if not path.is_symlink():  # what this call wrote (the engine removes its own partial save)
            shutil.rmtree(path, ignore_errors=True)
        raise _hf_write_failed(cfg, path, e) from e
    return path


def _hf_write_failed(cfg: RunConfig, path: Path, error: OSError) -> Exception:
    """A failed write of RUN_DIR/hf/step_N as one line: the checkpoint saved before it is intact."""
    saved = [p.name for p in complete_checkpoints(cfg.trainer.run_dir)]
    kept = f"checkpoint {saved[-1]} is intact" if saved else "no checkpoint was written"
    return write_failed(
        path,
        error,
        f"free disk space, then write the folder from the checkpoint with `rlloom export "
        f"{cfg.trainer.run_dir} {path}` ({kept}; a partial folder is never left under {path.parent}).",
    )


def resolve_checkpoint(source: str | os.PathLike) -> Path:
    """The checkpoint `source` names: itself, or the newest complete one of a run folder.

    A checkpoint is written in a `step_N.tmp-PID` sibling and renamed to `step_N` only when
    complete, so a `step_N` folder is whole; the engine's `load` checks its contents.
    """
    path = Path(source)
    if not path.is_dir():
        raise ConfigError(f"export source {str(source)!r} does not exist. Fix: pass {_WHERE}.")
    # A checkpoint (full: engine/, or weights-only: trainer_state.json beside hf/), not a run folder.
    if (path / "config.yaml").is_file() and (
        (path / ENGINE_DIR).is_dir() or (path / "trainer_state.json").is_file()
    ):
        if ".tmp-" in path.name:
            raise ConfigError(
                f"export source {str(source)!r} is an interrupted checkpoint save (a .tmp- folder). "
                "Fix: pass the run folder to take its newest complete checkpoint."
            )
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise ConfigError(
            f"export source {str(source)!r} has no complete checkpoint (RUN_DIR/checkpoints/step_N). "
            f"Fix: pass {_WHERE}; a run writes one at its end and every trainer.save_every steps."
        )
    return latest


def check_output(out: str | os.PathLike, what: str = "export output") -> Path:
    """`out` must be a new or empty folder (an export, or `what` else, never mixes with other files)."""
    path = Path(out)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ConfigError(
            f"{what} {str(out)!r} already exists and is not an empty folder. "
            "Fix: pass a new folder, or remove it first."
        )
    return path


def create_output(path: Path) -> None:
    """Create the checked output folder before any weights are read: one that cannot be is refused."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"export output {str(path)!r} cannot be created: {e.strerror or e}. Fix: pass a folder in a "
            "place you can write to."
        ) from e


def build_engine_from_checkpoint(ckpt: Path, *, critic: bool = False) -> tuple[RunConfig, TrainEngine]:
    """The training engine of a checkpoint (with `critic`, its critic's), on CPU in fp32, restored with
    its public `load` (a weights-only checkpoint's engine is built from its Hugging Face folder instead)."""
    cfg = load_config(ckpt / "config.yaml")
    weights_only = is_weights_only(ckpt)
    if critic:
        if weights_only or not (ckpt / CRITIC_DIR).is_dir():
            what = (
                "is weights-only"
                if weights_only
                else "has no critic/ (its run had no algorithm.estimator=gae)"
            )
            raise ConfigError(
                f"export --critic: checkpoint {str(ckpt)!r} {what}, so it holds no critic. Fix: pass a full "
                "checkpoint of a run with a critic, or drop --critic to export the policy."
            )
        check_model_folder(cfg.critic_model_path, "the run's critic.model_path")
        engine = build_offline(cfg, cfg.critic_model_path, critic=True)
        engine.load(str(ckpt / CRITIC_DIR))
        return cfg, engine
    if weights_only:
        verify_folder(ckpt)  # a full checkpoint's engine verifies its own files in `load`
    else:
        check_model_folder(cfg.model.path, "the run's model.path")
    engine = build_offline(cfg, str(ckpt / WEIGHTS_DIR) if weights_only else cfg.model.path)
    if not weights_only:
        engine.load(str(ckpt / ENGINE_DIR))
    return cfg, engine


def export_checkpoint(
    source: str | os.PathLike, out: str | os.PathLike, *, dtype: ExportDType = "auto", critic: bool = False
) -> Path:
    """`rlloom export`: write the policy of a checkpoint (or a run's newest) as a Hugging Face folder;
    with `critic`, its critic as a value model (transformers' *ForTokenClassification)."""
    out_path = check_output(out)
    ckpt = resolve_checkpoint(source)
    create_output(out_path)
    cfg, engine = build_engine_from_checkpoint(ckpt, critic=critic)
    model_path = cfg.critic_model_path if critic else cfg.model.path
    folder = save_hf_folder(engine, model_path, out_path, dtype=dtype, critic=critic)
    if not critic:  # a value model is not evaluated on a task
        write_task_file(cfg, folder)
    return folder
