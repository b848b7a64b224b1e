"""Persistent torch.compile caches: a second run of the same code and shapes loads its compiled
kernels from disk instead of compiling them again (issue 17, fast start).

`enable_compile_cache()` runs right before rlloom's two compilations, the per-layer training compile
(parallel/compile.py) and the rollout decode forward (engines/rollout/native/model_runner.py), so every
process that compiles (the CLI's train and eval, Ray actors, benchmarks, tests) sets it up before its
first compilation. It points torch's on-disk caches at one persistent directory and turns them on:

- Inductor's FX-graph cache (a traced graph -> its generated code) and the AOTAutograd cache (the
  forward and backward graphs of a training layer), under TORCHINDUCTOR_CACHE_DIR = the directory;
- the local autotune cache (the kernel configurations Inductor benchmarked), in the same place;
- Triton's kernel cache (compiled GPU binaries, also of rlloom's own Triton kernels):
  TRITON_CACHE_DIR = <directory>/triton.

The directory is `RLLOOM_COMPILE_CACHE` if set, else `$XDG_CACHE_HOME/rlloom/compile`, else
`~/.cache/rlloom/compile`: torch's default, /tmp/torchinductor_<user>, does not survive a reboot or a
fresh container. A TORCHINDUCTOR_CACHE_DIR or TRITON_CACHE_DIR the user exported wins over ours, and
TORCHINDUCTOR_FX_GRAPH_CACHE=0 or TORCHINDUCTOR_AUTOGRAD_CACHE=0 still turn a cache off (torch lets
those variables override the config).

Keying is torch's own: an entry's key hashes the graph, its inputs' shapes (symbolic where dynamic),
strides and dtypes, the Inductor configuration and the torch, Triton and GPU versions, so a change
of code or shapes compiles again and adds an entry; a stale entry is never used. Dynamo's tracing and
the CUDA-graph capture still run in every process; the cache saves Inductor's code generation, the
C++/Triton compilation and the autotuning. torch's "Mega-Cache" (torch.compiler.save_cache_artifacts
/ load_cache_artifacts) packs these same entries into one blob to carry to another machine; with a
directory that persists on the machine it adds nothing, so it is not used.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

from rlloom.config import UserError

logger = logging.getLogger(__name__)

ENV = "RLLOOM_COMPILE_CACHE"
"""Environment variable that overrides the default cache directory."""

_result: list[Path | None] = []  # enable_compile_cache's answer, once it has run in this process


def default_cache_dir(env: Mapping[str, str]) -> Path:
    """`RLLOOM_COMPILE_CACHE`, else `$XDG_CACHE_HOME/rlloom/compile`, else `~/.cache/rlloom/compile`."""
    if env.get(ENV):
        return Path(env[ENV]).expanduser()
    base = Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return base / "rlloom" / "compile"


def cache_env(env: Mapping[str, str]) -> dict[str, str]:
    """TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR for a process with environment `env`: the user's
    own values where set, else the rlloom directory and its `triton` folder. A TORCHINDUCTOR_CACHE_DIR
    equal to torch's default (/tmp/torchinductor_<user>) counts as unset: importing torch._dynamo
    writes that value into the environment itself."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir as torch_default_cache_dir

    inductor = env.get("TORCHINDUCTOR_CACHE_DIR", "")
    if inductor in ("", torch_default_cache_dir()):
        inductor = str(default_cache_dir(env))
    triton = env.get("TRITON_CACHE_DIR") or str(Path(inductor) / "triton")
    return {"TORCHINDUCTOR_CACHE_DIR": inductor, "TRITON_CACHE_DIR": triton}


def enable_compile_cache() -> Path | None:
    """Point this process's compile caches at the persistent directory and turn them on (idempotent);
    returns the Inductor cache directory, or None when the default one cannot be created (torch's
    own then serves, after a warning)."""
    if not _result:
        _result.append(_enable())
    return _result[0]


def _enable() -> Path | None:
    # Imported here, not at the top: importing Inductor pulls in Dynamo (about 0.7 s of CPU), which a
    # process that never compiles (every CPU run, each Ray actor of one) would pay at start-up.
    import torch._functorch.config
    import torch._inductor.config

    dirs = cache_env(os.environ)
    for name, path in dirs.items():
        try:
            Path(path).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            if not (os.environ.get(ENV) or os.environ.get(name) == path):  # our default: go without
                logger.warning("compile cache: cannot create %s (%s); using torch's default", path, e)
                return None
            raise UserError(
                f"compile cache directory {path} (from {ENV} or {name}) cannot be created: {e}. "
                f"Fix: point {ENV} at a writable directory."
            ) from e
    os.environ.update(dirs)  # child processes (Inductor's compile workers) read the same directories
    torch._inductor.config.fx_graph_cache = True
    torch._inductor.config.autotune_local_cache = True
    torch._functorch.config.enable_autograd_cache = True
    logger.info("compile cache: %s", dirs["TORCHINDUCTOR_CACHE_DIR"])
    return Path(dirs["TORCHINDUCTOR_CACHE_DIR"])
