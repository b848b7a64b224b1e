"""Load and save native models as Hugging Face checkpoint folders (config.json + safetensors).

- `from_pretrained(path_or_name, *, dtype, device)`: reads config.json, builds the model on the meta
  device, materialises it on `device`, then streams every tensor of the (possibly sharded, via
  model.safetensors.index.json) safetensors files into it; block-wise FP8 checkpoints (DeepSeek-V3's,
  Qwen3-FP8's) are dequantized as they are read (`fp8_checkpoint.py`). Missing, unexpected or mis-shaped tensors
  raise `CheckpointMismatch` naming the tensor and the shapes. `path_or_name` is a folder or the embedded
  model's name (`smollm2-135m-instruct`, built once by `embedded.py`).
- `value_model_from_pretrained(path_or_name)`: the body of a causal LM, or of a value or reward
  model (*ForTokenClassification / *ForSequenceClassification), and its `score` head: a critic's start.
- `save_pretrained(model, path)`: writes the original config.json dict unchanged, the weights
  under Hugging Face names (sharded with an index above `max_shard_bytes`), and copies tokenizer
  and generation files from the folder the model was loaded from (`value_model_config` and
  `extra` make it a value model's folder).
- `load_tokenizer(path_or_name)`: transformers' AutoTokenizer for the folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import itertools
import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from rlloom.data.images import ImageProcessing
from rlloom.models.adapter import CheckpointMismatch, hf_named_tensors, load_hf_tensors, missing_hf_names
from rlloom.models.args import ModelArgs
from rlloom.models.fp8_checkpoint import block_fp8_config, dequantized, unquantized_config
from rlloom.models.model import CausalLM
from rlloom.run_files import make_dir, write_text

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Files of a checkpoint folder that are not copied as "tokenizer and generation files" on save.
_NOT_COPIED_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_NOT_COPIED_NAMES = ("config.json", INDEX_FILE)
log = logging.getLogger(__name__)


def resolve_path(path_or_name: str | os.PathLike) -> Path:
    """The checkpoint folder for a path or the embedded model name."""
    from rlloom.models.embedded import EMBEDDED_NAME, ensure_embedded_model

    if str(path_or_name) == EMBEDDED_NAME:
        return ensure_embedded_model()
    path = Path(path_or_name)
    name = str(path_or_name)
    if not path.exists() and name.count("/") == 1 and not name.startswith((".", "/", "~")):
        raise ValueError(
            f"model path {name!r} is not a folder; it looks like a Hugging Face Hub id, and rlloom does "
            f"not download models. Fix: download it first (e.g. `huggingface-cli download {name} "
            f"--local-dir models/{name.split('/')[1]}`) and pass that folder."
        )
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model path {str(path_or_name)!r} is not a Hugging Face checkpoint folder (no config.json). "
            f"Fix: pass a folder with config.json and *.safetensors, or {EMBEDDED_NAME!r}."
        )
    return path


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    # Parameters are created in `dtype`; buffers that pin their own dtype (RoPE, expert bias) stay fp32.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder, in index order."""
    if (path / INDEX_FILE).is_file():
        weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        return [path / f for f in dict.fromkeys(weight_map.values())]
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    raise ValueError(
        f"checkpoint folder {str(path)!r} has neither {SINGLE_FILE} nor {INDEX_FILE}. "
        "Fix: convert the weights to safetensors (transformers save_pretrained does)."
    )


def _read_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of `files`; a NaN or infinite weight raises `CheckpointMismatch` naming it (each
    tensor is in memory here anyway, and a non-finite weight would make every logprob NaN later)."""
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                if tensor.is_floating_point() and tensor.element_size() > 1 and not tensor.isfinite().all():
                    raise CheckpointMismatch(
                        f"tensor {name!r} of {file} holds NaN or infinite values. Fix: use an intact copy of the "
                        "weights (a training run that diverged saves such weights)."
                    )
                yield name, tensor


def _config_and_block(path: Path) -> tuple[dict[str, Any], tuple[int, int] | None]:
    cfg = json.loads((path / "config.json").read_text())
    return unquantized_config(cfg), block_fp8_config(cfg, f"{path}/config.json")


def checkpoint_config(path: Path) -> dict[str, Any]:
    """A checkpoint folder's config.json as the model loaded from it has it: a block-wise FP8
    checkpoint's without `quantization_config` (its weights are read dequantized); other
    quantizations raise ValueError."""
    return _config_and_block(path)[0]


def read_checkpoint(path: Path) -> tuple[dict[str, Any], Iterator[tuple[str, torch.Tensor]]]:
    """(`checkpoint_config(path)`, every tensor of the folder's safetensors files under its Hugging
    Face name, one at a time, block-wise FP8 weights dequantized to fp32: `fp8_checkpoint.py`)."""
    cfg, block = _config_and_block(path)
    tensors = _read_tensors(weight_files(path))
    return cfg, (dequantized(tensors, block) if block else tensors)


def build_model(
    cfg: dict[str, Any], *, dtype: torch.dtype, device: str | torch.device, fused_projections: bool = False
) -> CausalLM:
    """A model in `dtype` on `device` whose parameters are uninitialised (garbage until loaded) and
    whose buffers hold what the constructor gives them: the persistent ones (DeepSeek-V3's router
    `expert_bias`, saved with the weights) zero, the non-persistent ones (RoPE) computed.

    Built on the meta device and materialised by `to_empty`, which leaves every tensor garbage; a
    model that then had only its parameters set (random weights for a benchmark or a test) chose
    its DeepSeek-V3 experts with a garbage bias, different on every rank and every run."""
    args = dataclasses.replace(ModelArgs.from_hf_config(cfg), fused_projections=fused_projections)
    with _default_dtype(dtype), torch.device("meta"):
        model = CausalLM(args, cfg)
    model = model.to_empty(device=device)
    zero_persistent_buffers(model)
    model.init_buffers()
    return model


def zero_persistent_buffers(module: nn.Module) -> None:
    """Zero the buffers saved with the weights (DeepSeek-V3's router `expert_bias`: zero in a new
    model, as in Hugging Face's), which `to_empty` leaves garbage."""
    persistent = module.state_dict().keys()
    with torch.no_grad():
        for name, buffer in module.named_buffers():
            if name in persistent:
                buffer.zero_()


def from_pretrained(
    path_or_name: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    fused_projections: bool = False,
) -> CausalLM:
    """Load a Hugging Face checkpoint folder (or the embedded model) as a native CausalLM
    (`fused_projections`: one matmul for q/k/v and one for gate/up, as the rollout engine runs)."""
    path = resolve_path(path_or_name)
    cfg, tensors = read_checkpoint(path)
    model = build_model(cfg, dtype=dtype, device=device, fused_projections=fused_projections)
    _check_complete(model, load_hf_tensors(model, tensors), path)
    model.source_path = str(path)
    return model.eval()


def value_model_from_pretrained(
    path_or_name: str | os.PathLike, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[CausalLM, dict[str, torch.Tensor]]:
    """A checkpoint as a value model reads it: the native CausalLM's body without its vocabulary head
    (`output` None), and the checkpoint's linear `score` head ({} when it has none).

    The folder holds a causal LM (its `lm_head.weight` is skipped), or a value or reward model:
    transformers' *ForTokenClassification (verl's critic; `rlloom export --critic` writes one) or
    *ForSequenceClassification (a reward model: no bias) with one label, whose body sits under the
    causal LM's `model.*` names beside `score.weight` [1, D] and maybe `score.bias` [1]."""
    path = resolve_path(path_or_name)
    cfg, tensors = read_checkpoint(path)
    model = build_model(cfg, dtype=dtype, device=device)
    model.output = None
    score: dict[str, torch.Tensor] = {}

    def body() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in tensors:
            if name in SCORE_NAMES:
                score[name] = tensor.to(torch.float32)
            elif name != "lm_head.weight":
                yield name, tensor

    _check_complete(model, load_hf_tensors(model, body()), path)
    expected = {"score.weight": [1, model.args.hidden_size], "score.bias": [1]}
    for name, tensor in sorted(score.items(), key=lambda item: SCORE_NAMES.index(item[0])):
        if list(tensor.shape) != expected[name]:
            raise CheckpointMismatch(
                f"checkpoint {str(path)!r} has {name} of shape {list(tensor.shape)}, but a value model has one "
                f"output: {expected[name]}. Fix: pass a critic or reward model with one label (num_labels=1), "
                "or a causal LM (its value head then starts at zero)."
            )
    if score and "score.weight" not in score:
        raise CheckpointMismatch(
            f"checkpoint {str(path)!r} has score.bias but no score.weight. Fix: check its weights."
        )
    model.source_path = str(path)
    return model.eval(), score


VALUE_MODEL_SUFFIXES = ("ForTokenClassification", "ForSequenceClassification")
"""Architectures of transformers' value and reward models (a linear `score` head, no lm head)."""
SCORE_NAMES = ("score.weight", "score.bias")
"""The linear value (or reward) head of transformers' *ForTokenClassification and
*ForSequenceClassification checkpoints, by Hugging Face name."""


def value_model_config(hf_config: dict[str, Any]) -> dict[str, Any]:
    """config.json of a value model (transformers' *ForTokenClassification with one label, no
    dropout before the head) with the body of the model `hf_config` describes."""
    arch = (hf_config.get("architectures") or [""])[0]
    for suffix in ("ForCausalLM", *VALUE_MODEL_SUFFIXES):
        if arch.endswith(suffix):
            arch = arch.removesuffix(suffix)
            break
    arch = arch or hf_config.get("model_type", "").title().replace("_", "")
    out = dict(hf_config)
    out |= {
        "architectures": [f"{arch}ForTokenClassification"],
        "id2label": {"0": "LABEL_0"},
        "label2id": {"LABEL_0": 0},
        "classifier_dropout": 0.0,
    }
    out.pop("num_labels", None)
    return out


def _check_complete(model: CausalLM, filled: set, path: Path) -> None:
    missing = missing_hf_names(model, filled)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise CheckpointMismatch(
            f"checkpoint {str(path)!r} is missing {len(missing)} tensor(s) the {model.args.model_type} model "
            f"needs: {shown} (expected shapes in brackets). Fix: check that config.json matches the weights."
        )


def _shards(
    model: CausalLM, max_shard_bytes: int, extra: dict[str, torch.Tensor]
) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in itertools.chain(hf_named_tensors(model), extra.items()):
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        # clone: expert rows are views of one stacked tensor and safetensors refuses shared storage.
        shards[-1][name] = tensor.detach().to("cpu").clone()
        size += nbytes
    return shards


def save_pretrained(
    model: CausalLM,
    path: str | os.PathLike,
    *,
    max_shard_bytes: int = 5 * 1024**3,
    extra: dict[str, torch.Tensor] | None = None,
) -> None:
    """Write config.json, safetensors (sharded above max_shard_bytes) and the source's tokenizer files;
    `extra`: more tensors under their Hugging Face names (a value model's `score` head)."""
    out = make_dir(path)
    write_text(out / "config.json", json.dumps(model.hf_config, indent=2, sort_keys=True) + "\n")
    shards = _shards(model, max_shard_bytes, extra or {})
    if len(shards) == 1:
        _save_file(shards[0], out / SINGLE_FILE)
    else:
        weight_map, total = {}, 0
        for i, shard in enumerate(shards, start=1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            _save_file(shard, out / file)
            weight_map |= dict.fromkeys(shard, file)
            total += sum(t.numel() * t.element_size() for t in shard.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        write_text(out / INDEX_FILE, json.dumps(index, indent=2, sort_keys=True) + "\n")
    _copy_side_files(model.source_path, out)


def _save_file(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors' `save_file`, its I/O errors (a full disk) raised as the OSError they are."""
    try:
        save_file(tensors, str(path), metadata={"format": "pt"})
    except SafetensorError as e:
        number = re.search(r"os error (\d+)", str(e))
        code = int(number.group(1)) if number else errno.EIO
        raise OSError(code, os.strerror(code), str(path)) from e


def _copy_side_files(source: str | None, out: Path) -> None:
    """Copy the tokenizer and generation files of `source` into `out`; a link whose target is outside
    the model's own files (see `_link_root`) is skipped with a warning, so a linked secret
    (`vocab.txt -> ~/.netrc`) never ships with a published model."""
    if source is None or Path(source).resolve() == out.resolve():
        return
    root = _link_root(Path(source))
    for file in Path(source).iterdir():
        if (
            not file.is_file()
            or file.name.startswith(".")
            or file.name in _NOT_COPIED_NAMES
            or file.name.endswith(_NOT_COPIED_SUFFIXES)
        ):
            continue
        if file.is_symlink() and not file.resolve().is_relative_to(root):
            if file not in _warned_links:
                _warned_links.add(file)
                log.warning(
                    "model file %s is a link to %s, outside the model's folder %s: it is not copied into "
                    "the Hugging Face folders written from this model. Fix: copy the file into the model "
                    "folder if it belongs to the model.",
                    file,
                    file.resolve(),
                    root,
                )
            continue
        shutil.copy2(file, out / file.name)


_warned_links: set[Path] = set()
"""Links already warned about (a run writes a Hugging Face folder every trainer.save_hf_every steps)."""


def _link_root(folder: Path) -> Path:
    """Where the links of a model folder may point to be copied: inside the folder itself, or, for a
    snapshot of the Hugging Face Hub cache (`models--org--name/snapshots/REV`, whose files link to
    `../../blobs/SHA`), inside that model's cache folder `models--org--name`."""
    real = folder.resolve()
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith("models--"):
        return real.parent.parent
    return real


def load_tokenizer(path_or_name: str | os.PathLike) -> Any:
    """transformers.AutoTokenizer for a checkpoint folder or the embedded model."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(resolve_path(path_or_name)))


def load_image_processing(path_or_name: str | os.PathLike) -> ImageProcessing | None:
    """How the checkpoint's model reads pictures (transformers' `AutoImageProcessor` of the folder, its
    image placeholder token and merge size); None for a text-only model."""
    folder = resolve_path(path_or_name)
    vision = ModelArgs.from_hf_config(json.loads((folder / "config.json").read_text())).vision
    if vision is None:
        return None
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(str(folder))
    return ImageProcessing(
        processor=processor, image_token_id=vision.image_token_id, merge=vision.spatial_merge_size
    )


def load_decoder(path_or_name: str | os.PathLike) -> Callable[[list[int]], str] | None:
    """Token ids -> text (special tokens skipped) with the checkpoint's tokenizer; None when the
    folder has no tokenizer (e.g. a weights-only benchmark checkpoint)."""
    folder = resolve_path(path_or_name)
    if not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    tokenizer = load_tokenizer(folder)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
