"""Save and load the full training state with torch.distributed.checkpoint (DCP), crash-safely.

Layout of a checkpoint folder:

    dcp/               model and optimizer state, sharded by DCP (any rank count can read it back)
    rng_rank<r>.pt     torch, CUDA, Python and NumPy random states of rank r
    engine_state.json  step counters and settings
    manifest.json      every other file with its size, written last

Everything is written into `<dir>.tmp` and renamed to `<dir>` only after the manifest is on disk,
so a crash mid-save leaves the previous checkpoint untouched. Loading checks the manifest first
and refuses a folder with a missing or truncated file, naming it.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

try:
    import numpy as np
except ImportError:  # NumPy is a dependency of rlloom, but the engine does not need it
    np = None

MANIFEST = "manifest.json"
ENGINE_STATE = "engine_state.json"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _state_dicts(model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
    if optimizers:
        model_sd, optim_sd = get_state_dict(model, optimizers)
        return {"model": model_sd, "optim": optim_sd}
    return {"model": get_model_state_dict(model)}


def rng_state() -> dict[str, Any]:
    """Every random generator this process uses."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if np is not None:
        state["numpy"] = np.random.get_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state and np is not None:
        np.random.set_state(state["numpy"])


def save_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    extra_tensors: dict[str, torch.Tensor],
    engine_state: dict[str, Any],
) -> None:
    """Write a checkpoint to `path` (every rank calls this; `path` is on a shared filesystem)."""
    final = Path(path)
    tmp = final.with_name(final.name + ".tmp")
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    state = _state_dicts(model, optimizers)
    if extra_tensors:
        state["extra"] = extra_tensors
    with warnings.catch_warnings():  # DCP warns that it runs without a process group; we know
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=str(tmp / "dcp"), no_dist=not _distributed())
    world_size = dist.get_world_size() if _distributed() else 1
    torch.save(rng_state(), tmp / f"rng_rank{_rank()}.pt")
    if _rank() == 0:
        (tmp / ENGINE_STATE).write_text(json.dumps({**engine_state, "world_size": world_size}, indent=1))
    _barrier()
    if _rank() == 0:
        files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
        with open(tmp / MANIFEST, "w") as f:
            json.dump({"files": files}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        old = final.with_name(final.name + ".old")
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()


def check_complete(path: str | os.PathLike) -> dict[str, Any]:
    """Raise ValueError unless `path` is a complete checkpoint; returns its engine state."""
    root = Path(path)
    manifest = root / MANIFEST
    if not manifest.is_file():
        raise ValueError(
            f"checkpoint {str(root)!r} is incomplete: {MANIFEST} is missing (it is written last, so the save "
            "was interrupted or this is not an rlloom checkpoint). Fix: load an earlier complete checkpoint."
        )
    for name, size in json.loads(manifest.read_text())["files"].items():
        file = root / name
        if not file.is_file():
            raise ValueError(
                f"checkpoint {str(root)!r} is damaged: file {name!r} listed in {MANIFEST} is missing. "
                "Fix: restore the file or load an earlier complete checkpoint."
            )
        if file.stat().st_size != size:
            raise ValueError(
                f"checkpoint {str(root)!r} is damaged: file {name!r} has {file.stat().st_size} bytes, "
                f"{MANIFEST} says {size}. Fix: restore the file or load an earlier complete checkpoint."
            )
    return json.loads((root / ENGINE_STATE).read_text())


def load_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    extra_tensors: dict[str, torch.Tensor],
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Load `path` into `model` and `optimizers` in place and restore this rank's RNG states.

    `extra_tensors` are templates (right shapes and layouts) for the extra state saved alongside;
    returns (engine state, loaded extra tensors).
    """
    engine_state = check_complete(path)
    root = Path(path)
    state = _state_dicts(model, optimizers)
    if extra_tensors:
        state["extra"] = extra_tensors
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(root / "dcp"), no_dist=not _distributed())
    if optimizers:
        set_state_dict(model, optimizers, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        set_model_state_dict(model, state["model"])
    # With another rank count than at save time, ranks reuse the saved ranks' streams cyclically.
    saved_rank = _rank() % engine_state["world_size"]
    set_rng_state(torch.load(root / f"rng_rank{saved_rank}.pt", weights_only=False))
    return engine_state, state.get("extra", {})
