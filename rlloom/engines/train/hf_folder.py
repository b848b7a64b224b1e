"""Write a training engine's current weights as a Hugging Face folder (config, tokenizer, safetensors).

`save_hf_folder(engine, model_path, out)` takes the weights the way weight sync does, through the
engine's `named_weights` (Hugging Face names, full tensors, FSDP shards gathered), copies them into
a fresh native model in the export dtype on CPU, and writes that with `rlloom.models.save_pretrained`
(config.json of the starting model, safetensors, and the starting folder's tokenizer files). So the
folder loads with transformers' `AutoModelForCausalLM` and serves with vLLM/SGLang, whatever the
training layout was.

`named_weights` gathers shards with collectives: on several ranks every rank calls this function,
and only the one with `write=True` builds the model and writes. The folder appears atomically
(written to a temporary sibling, then renamed). A critic's folder is a value model (transformers'
*ForTokenClassification with one label: the body's tensors and the `score` head).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Literal

import torch

from rlloom.engines.train.base import TrainEngine
from rlloom.models import load_hf_tensors, save_pretrained
from rlloom.models.adapter import missing_hf_names
from rlloom.models.checkpoint import (
    SCORE_NAMES,
    build_model,
    checkpoint_config,
    resolve_path,
    value_model_config,
)
from rlloom.run_files import fresh_dir, refuse_link

ExportDType = Literal["auto", "float32", "bfloat16", "float16"]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_dtype_name(hf_config: dict) -> str:
    """The dtype a Hugging Face config.json declares (`dtype`, formerly `torch_dtype`); float32 if none."""
    name = hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32"
    return name if name in _DTYPES else "float32"


def save_hf_folder(
    engine: TrainEngine,
    model_path: str,
    out: str | os.PathLike,
    *,
    dtype: ExportDType = "auto",
    write: bool = True,
    critic: bool = False,
) -> Path:
    """Write `engine`'s weights as a Hugging Face folder at `out` (replacing it) and return the path.

    `model_path`: the folder (or embedded model name) the engine's model started from, for config.json
    and the tokenizer. `dtype`: the safetensors dtype; `auto` keeps the starting model's own dtype.
    `critic`: `engine` is a critic (head `value`): the folder is a value model, transformers'
    *ForTokenClassification with one label (loadable as `critic.model_path` again).
    """
    source = resolve_path(model_path)
    hf_config = checkpoint_config(source)  # the weights written are never quantized
    if critic:
        hf_config = value_model_config(hf_config)
    name = model_dtype_name(hf_config) if dtype == "auto" else dtype
    torch_dtype = _DTYPES[name]
    model = build_model(hf_config, dtype=torch_dtype, device="cpu") if write else None
    if model is not None and critic:
        model.output = None  # a value model has no vocabulary head
    filled, score = set(), {}
    for bucket in engine.named_weights(dtype=torch_dtype):
        if model is not None:
            body = [(n, t.cpu()) for n, t in bucket if n not in SCORE_NAMES]
            score |= {n: t.cpu() for n, t in bucket if n in SCORE_NAMES}
            filled |= load_hf_tensors(model, body)
    out = Path(out)
    if model is None:
        return out
    if critic and set(score) != set(SCORE_NAMES):
        raise RuntimeError(f"the critic's named_weights gave {sorted(score)}, not {list(SCORE_NAMES)}")
    missing = missing_hf_names(model, filled)
    if missing:
        raise RuntimeError(
            f"the engine's named_weights did not cover {len(missing)} tensor(s): {missing[:4]}"
        )
    for key in ("dtype", "torch_dtype"):
        if key in hf_config or (key == "dtype" and "torch_dtype" not in hf_config):
            hf_config[key] = name
    model.hf_config = hf_config
    model.source_path = str(source)
    tmp = fresh_dir(out.with_name(f"{out.name}.tmp-{os.getpid()}"))
    try:
        save_pretrained(model, tmp, extra=score)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if refuse_link(out).exists():
        shutil.rmtree(out) if any(out.iterdir()) else out.rmdir()
    os.replace(tmp, out)
    return out
