"""Checks of a Hugging Face model folder before anything is allocated from it (train, eval, export).

A model folder is third-party input: its config.json sizes every tensor the model allocates, its
weight files are parsed, its tokenizer files are parsed and its chat template is a program. Each
check below reads only small things (config.json, the safetensors headers, the tokenizer) and ends
with one `ConfigError` naming the setting, the folder or file, the rule and the fix:

- `read_config`: config.json is a JSON object without NaN or Infinity.
- `check_sizes`: the sizes (hidden_size, num_hidden_layers, heads, widths, vocabulary, experts) are
  positive integers, and the supported-architecture rules of `ModelArgs.from_hf_config` hold.
- `weight_shapes`: the weights are safetensors (a pickle such as pytorch_model.bin is never read),
  every file an index names lies inside the folder (by name: no `..`, not absolute) and exists, and
  every header is whole: its tensors fit its file exactly (a truncated or damaged file is named
  before any tensor is read).
- `check_against_weights`: config.json describes the model the weights hold: each decoder layer has
  tensors, and its parameter count is not more than twice theirs (hidden_size 10**9 or
  num_hidden_layers 10**7 would otherwise allocate terabytes, or spin, before a shape is compared).
- `check_tokenizer`: the tokenizer files exist and load, and the chat template renders a short
  conversation in a child process within `TEMPLATE_TIMEOUT_S` seconds, `TEMPLATE_MEMORY_BYTES` of
  memory and `TEMPLATE_MAX_CHARS` characters (a template that raises, loops or renders gigabytes).
Non-finite weights are found as they are read (`rlloom.models.checkpoint`), where each tensor
passes through memory anyway.
"""

from __future__ import annotations

import json
import math
import os
import re
import resource
import select
import signal
import struct
from pathlib import Path
from typing import Any

from rlloom.config import ConfigError
from rlloom.data.chat import prompt_messages
from rlloom.models.args import ModelArgs, language_config
from rlloom.models.checkpoint import INDEX_FILE, SINGLE_FILE, load_tokenizer, resolve_path
from rlloom.models.families import FAMILIES
from rlloom.plan.counts import model_costs

SIZE_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "moe_intermediate_size",
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "num_experts_per_tok",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "max_position_embeddings",
)
"""config.json sizes that, when present (and not null), must be positive integers."""
REQUIRED_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
    "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
}  # fmt: skip
"""Bytes of one element of each safetensors dtype."""
MAX_HEADER_BYTES = 100 * 2**20
"""safetensors' own limit on a header."""
TEMPLATE_TIMEOUT_S = 10.0
TEMPLATE_MEMORY_BYTES = 2**30
"""Memory the template's child process may take beyond what it starts with (a fork of this one)."""
TEMPLATE_MAX_CHARS = 2**20


def check_model_folder(path: str, setting: str) -> dict[str, Any]:
    """The folder's config.json once config and weights pass every check (`setting` names it)."""
    try:
        folder = resolve_path(path)
    except ValueError as e:
        raise ConfigError(f"{setting}={path!r} is invalid: {' '.join(str(e).split())}") from None
    where = f"{setting}={path!r}"
    cfg = read_config(folder, where)
    args = check_sizes(cfg, where)
    check_against_weights(args, cfg, weight_shapes(folder, where), where)
    return cfg


def read_config(folder: Path, where: str) -> dict[str, Any]:
    """config.json as a dict: a JSON object, no NaN or Infinity anywhere in it; a vision-language
    model's language fields at the top level (`language_config`)."""

    def refuse(constant: str) -> float:
        raise ValueError(f"it holds {constant}, which is not a number a config can use")

    try:
        cfg = json.loads((folder / "config.json").read_text(), parse_constant=refuse)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(
            f"{where} is invalid: {folder / 'config.json'} does not read as JSON ({' '.join(str(e).split())}). "
            "Fix: restore the config.json that came with the weights."
        ) from None
    if not isinstance(cfg, dict):
        raise ConfigError(
            f"{where} is invalid: {folder / 'config.json'} is a JSON {type(cfg).__name__}, not an object. "
            "Fix: restore the config.json that came with the weights."
        )
    return language_config(cfg)


def check_sizes(cfg: dict[str, Any], where: str) -> ModelArgs:
    """The model's sizes are positive integers and its architecture is supported."""
    fix = "Fix: restore the config.json that came with the weights."
    for key in REQUIRED_KEYS:
        if key not in cfg:
            raise ConfigError(f"{where} is invalid: config.json has no {key}. {fix}")
    for key in SIZE_KEYS:
        value = cfg.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ConfigError(
                f"{where} is invalid: config.json {key}={value!r} must be a positive integer. {fix}"
            )
    for key in ("rms_norm_eps", "rope_theta"):
        value = cfg.get(key)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int | float) or value <= 0
        ):
            raise ConfigError(
                f"{where} is invalid: config.json {key}={value!r} must be a positive number. {fix}"
            )
    try:
        return ModelArgs.from_hf_config(cfg)
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{where} cannot run here: {' '.join(str(e).split())}") from None


def weight_files(folder: Path, where: str) -> list[Path]:
    """The safetensors files of the folder: each one an index names inside the folder and present."""
    if (folder / INDEX_FILE).is_file():
        try:
            weight_map = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
            names = list(dict.fromkeys(weight_map.values()))
            assert all(isinstance(n, str) for n in names)
        except (OSError, ValueError, KeyError, TypeError, AttributeError, AssertionError):
            raise ConfigError(
                f"{where} is invalid: {folder / INDEX_FILE} is not an index (a JSON object with a weight_map "
                "of tensor names to file names). Fix: restore the index that came with the weights."
            ) from None
        files = []
        for name in names:
            # by name, not by resolving links: a Hub cache snapshot's files link to ../../blobs/
            file = folder / name
            if Path(name).is_absolute() or ".." in Path(name).parts:
                raise ConfigError(
                    f"{where} is invalid: {INDEX_FILE} names {name!r}, a file outside the model folder; rlloom "
                    "reads weights only from the folder itself. Fix: restore the index that came with the weights."
                )
            if not file.is_file():
                raise ConfigError(
                    f"{where} is invalid: {INDEX_FILE} names {name!r}, which is missing from the folder. "
                    "Fix: copy every weight file of the model into the folder."
                )
            files.append(file)
        return files
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
    held = f"holds only {', '.join(pickles[:3])} (PyTorch pickles, which rlloom never reads: loading one can run code)"
    raise ConfigError(
        f"{where} is invalid: the folder has no {SINGLE_FILE} or {INDEX_FILE}; it "
        f"{held if pickles else 'holds no weights'}. Fix: convert the model to safetensors (transformers: "
        "AutoModelForCausalLM.from_pretrained(folder).save_pretrained(folder)) or pass a folder with them."
    )


def weight_shapes(folder: Path, where: str) -> dict[str, list[int]]:
    """Tensor name -> shape over every weight file, from the headers alone (each file checked whole)."""
    shapes: dict[str, list[int]] = {}
    for file in weight_files(folder, where):
        problem, header = _read_header(file)
        if problem:
            raise ConfigError(
                f"{where} is invalid: {file} is not a whole safetensors file ({problem}). Fix: download or "
                "copy the file again (it may be truncated)."
            )
        shapes |= {name: entry["shape"] for name, entry in header.items() if name != "__metadata__"}
    return shapes


def _read_header(file: Path) -> tuple[str, dict[str, Any]]:
    """(why `file` is not a whole safetensors file or '', its header)."""
    try:
        size = file.stat().st_size
        with file.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8).ljust(8, b"\0"))
            if size < 8 or length > min(size - 8, MAX_HEADER_BYTES):
                return f"its header claims {length} bytes, the file has {size}", {}
            header = json.loads(f.read(length))
    except (OSError, ValueError) as e:
        return f"{type(e).__name__}: {' '.join(str(e).split())[:120]}", {}
    if not isinstance(header, dict):
        return "its header is not a JSON object", {}
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            start, stop = entry["data_offsets"]
            count = math.prod(entry["shape"])
            assert all(isinstance(n, int) and n >= 0 for n in (*entry["shape"], start, stop))
            assert stop - start == count * DTYPE_BYTES[entry["dtype"]]
        except (KeyError, TypeError, ValueError, AssertionError):
            return f"tensor {name!r} has a broken entry {str(entry)[:120]}", {}
        end = max(end, stop)
    if end != size - 8 - length:
        return f"its tensors need {end} bytes of data and the file holds {size - 8 - length}", {}
    return "", header


def check_against_weights(
    args: ModelArgs, cfg: dict[str, Any], shapes: dict[str, list[int]], where: str
) -> None:
    """config.json's layers and parameter count against the tensors the weight files hold."""
    layer_re = re.compile(rf"^{re.escape(FAMILIES[args.model_type].decoder_prefix)}layers\.(\d+)\.")
    layers = {int(m.group(1)) for name in shapes if (m := layer_re.match(name))}
    held = sum(1 for i in layers if i < args.num_layers)
    if held < args.num_layers:
        raise ConfigError(
            f"{where} is invalid: config.json num_hidden_layers={args.num_layers}, but the weights hold tensors "
            f"of {held} of those layers. Fix: restore the config.json that came with the weights."
        )
    described = model_costs(args).total_params
    weights = sum(math.prod(shape) for shape in shapes.values())
    if described > 2 * weights:
        sizes = ", ".join(
            f"{k}={cfg[k]}" for k in ("hidden_size", "intermediate_size", "vocab_size") if k in cfg
        )
        raise ConfigError(
            f"{where} is invalid: config.json ({sizes}, num_hidden_layers={args.num_layers}) describes a model "
            f"of {described:,} parameters, but the weight files hold {weights:,}. Fix: restore the config.json "
            "that came with the weights."
        )


def check_tokenizer(path: str, setting: str, *, chat_template: bool, system_prompt: str = "") -> None:
    """The tokenizer loads and encodes text; with `chat_template`, its template renders in bounds."""
    folder = resolve_path(path)
    where = f"{setting}={path!r}"
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((folder / n).exists() for n in names):
        raise ConfigError(
            f"{where} is invalid: the folder has no tokenizer ({', '.join(names)}). Fix: copy the tokenizer "
            "files of the model (or of its base model) into the folder."
        )
    try:  # a third-party parser of damaged files: any exception is the folder's, said in one line
        tokenizer = load_tokenizer(folder)
        assert tokenizer.encode("1 + 1 = 2", add_special_tokens=False), "it encodes text as no tokens"
    except Exception as e:  # noqa: BLE001
        raise ConfigError(
            f"{where} is invalid: its tokenizer does not load ({type(e).__name__}: "
            f"{' '.join(str(e).split())[:200]}). Fix: copy the tokenizer files of the model into the folder again."
        ) from None
    if chat_template and getattr(tokenizer, "chat_template", None) is not None:
        problem = render_in_bounds(tokenizer, prompt_messages("What is 1 + 1?", system_prompt))
        if problem:
            raise ConfigError(
                f"{where} is invalid: its chat template {problem}. Fix: repair chat_template (chat_template.jinja "
                "or tokenizer_config.json), or set data.chat_template=false."
            )


def render_in_bounds(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """'' when the chat template renders `messages` in a forked child within the time, memory and size
    bounds; otherwise what went wrong (jinja loops cannot be interrupted in a thread, and a template
    that builds gigabytes would take this process's memory with it). A plain fork, not a
    multiprocessing.Process: that refuses to start from a daemonic process (a run launched by one)."""
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: render, answer, leave at once
        try:
            os.close(reader)
            os.write(writer, ("ok:" + _render_problem(tokenizer, messages)).encode()[:4096])
        finally:
            os._exit(0)
    os.close(writer)
    try:
        ready, _, _ = select.select([reader], [], [], TEMPLATE_TIMEOUT_S)
        answer = os.read(reader, 4096).decode(errors="replace") if ready else None
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(reader)
    if answer is None:
        return f"did not render a two-message chat within {TEMPLATE_TIMEOUT_S:g} s (it may loop without end)"
    if not answer.startswith("ok:"):
        return "crashed the process that rendered a two-message chat"
    return answer[3:]


def _render_problem(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """In the child: cap the memory, render; '' or the problem."""
    with open("/proc/self/statm") as f:
        in_use = int(f.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (in_use + TEMPLATE_MEMORY_BYTES, resource.RLIM_INFINITY))
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        too_long = isinstance(text, str) and len(text) > TEMPLATE_MAX_CHARS
        problem = f"rendered {len(text):,} characters for a two-message chat" if too_long else ""
    except MemoryError:
        problem = (
            f"took more than {TEMPLATE_MEMORY_BYTES / 2**30:g} GiB of memory to render a two-message chat"
        )
    except Exception as e:  # noqa: BLE001  (any error of the template's program is the folder's)
        problem = f"raises on a two-message chat ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
    return problem
