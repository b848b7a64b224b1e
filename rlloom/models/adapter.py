"""State-dict adapter: Hugging Face tensor names <-> native CausalLM names, per architecture.

The Hugging Face side is the checkpoint format on the Hub (what transformers' save_pretrained
writes): one tensor per expert, e.g. `model.layers.3.mlp.experts.7.gate_proj.weight` (Qwen3-MoE,
DeepSeek-V3) or `model.layers.3.block_sparse_moe.experts.7.w1.weight` (Mixtral). Natively the
experts of a layer are stacked: `layers.3.moe.experts.w1` [E, I, D]; expert j is row j.

API used by the engines:
- `hf_named_tensors(model)` yields (hf_name, tensor) for every weight (experts split, views of the
  live parameters; no lm_head when embeddings are tied; a fused q/k/v or gate/up projection yields
  its parts under their own names). Weight sync and saving use it.
- `load_hf_tensors(model, named_tensors)` copies HF-named tensors IN PLACE into the existing
  parameters (`param.copy_`, no reallocation; an expert tensor lands in its slot of the stack) and
  returns the set of native keys it filled. The rollout engine's update_weights calls it; a partial
  update is fine. Unknown names and wrong shapes raise `CheckpointMismatch` naming the tensor and the shapes.
  DeepSeek-V3 multi-token-prediction layers (index >= num_hidden_layers) are skipped and logged.
- `StateDictAdapter(args).from_hf(name)` / `.hf_name(native, expert)` for single names.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from rlloom.config import UserError
from rlloom.models.args import ModelArgs
from rlloom.models.families import FAMILIES
from rlloom.models.fp8 import Fp8Rows, Fp8Weights, load_rows
from rlloom.models.layers import FusedLinear


class CheckpointMismatch(UserError):
    """A checkpoint's tensors do not fit the model its config.json describes (a missing, unexpected
    or mis-shaped tensor): a user's checkpoint, so the CLI prints the message on one line."""


logger = logging.getLogger(__name__)

NativeKey = tuple[str, int | None]
"""(native parameter name, expert index or None)."""

_TOWER = "visual."
"""Native prefix of a vision tower's tensors."""
_NATIVE_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_STACKED_RE = re.compile(r"^moe\.experts\.(w[123])$")


class StateDictAdapter:
    """Name mapping for one architecture (its family's names: rlloom/models/families/)."""

    def __init__(self, args: ModelArgs) -> None:
        self.args = args
        self.family = FAMILIES[args.model_type]
        layer_map = dict(self.family.names.layer)
        experts = self.family.names.experts
        self._layer_hf_to_native = layer_map
        self._layer_native_to_hf = {v: k for k, v in layer_map.items()}
        self._experts = experts
        self._expert_re = (
            re.compile(rf"^{re.escape(experts[0])}(\d+)\.({'|'.join(experts[1])})\.weight$")
            if experts
            else None
        )
        decoder = self.family.decoder_prefix
        self._top = {
            f"{decoder}embed_tokens.weight": "tok_embeddings.weight",
            f"{decoder}norm.weight": "norm.weight",
            "lm_head.weight": "output.weight",
        }
        self._layer_re = re.compile(rf"^{re.escape(decoder)}layers\.(\d+)\.(.+)$")

    def is_mtp_layer(self, hf_name: str) -> bool:
        """Multi-token-prediction layers (DeepSeek-V3) sit after the last decoder layer."""
        m = self._layer_re.match(hf_name)
        return self.family.mtp_layers and m is not None and int(m.group(1)) >= self.args.num_layers

    def from_hf(self, hf_name: str) -> NativeKey | None:
        """Native key of an HF tensor name, or None when the name is not part of this architecture."""
        if hf_name in self._top:
            return self._top[hf_name], None
        tower = self.family.tower_prefix
        if tower is not None and hf_name.startswith(tower):
            return _TOWER + hf_name.removeprefix(tower), None
        m = self._layer_re.match(hf_name)
        if m is None:
            return None
        layer, rest = m.group(1), m.group(2)
        if rest in self._layer_hf_to_native:
            return f"layers.{layer}.{self._layer_hf_to_native[rest]}", None
        if self._expert_re is not None:
            e = self._expert_re.match(rest)
            if e is not None:
                return f"layers.{layer}.moe.experts.{self._experts[1][e.group(2)]}", int(e.group(1))
        return None

    def hf_name(self, native_name: str, expert: int | None = None) -> str:
        """HF tensor name of a native parameter (or of one expert of a stacked parameter)."""
        for hf, nat in self._top.items():
            if nat == native_name:
                return hf
        if self.family.tower_prefix is not None and native_name.startswith(_TOWER):
            return self.family.tower_prefix + native_name.removeprefix(_TOWER)
        m = _NATIVE_LAYER_RE.match(native_name)
        assert m is not None, native_name
        layer, rest = m.group(1), m.group(2)
        stacked = _STACKED_RE.match(rest)
        if stacked is not None:
            assert expert is not None and self._experts is not None, native_name
            prefix, projections = self._experts
            proj = next(hf for hf, nat in projections.items() if nat == stacked.group(1))
            return f"{self.family.decoder_prefix}layers.{layer}.{prefix}{expert}.{proj}.weight"
        return f"{self.family.decoder_prefix}layers.{layer}.{self._layer_native_to_hf[rest]}"

    def to_hf(
        self, native_name: str, tensor: torch.Tensor, *, first_expert: int = 0
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(hf_name, tensor) pairs for one native tensor; stacked experts yield one per expert, row j
        being expert `first_expert + j` (a block of the stack, e.g. one expert-parallel rank's)."""
        rest = _NATIVE_LAYER_RE.match(native_name)
        if rest is not None and _STACKED_RE.match(rest.group(2)):
            for j in range(tensor.shape[0]):
                yield self.hf_name(native_name, first_expert + j), tensor[j]
        else:
            yield self.hf_name(native_name), tensor


def separate_fused(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (a state dict of `model`) with each `FusedLinear` tensor replaced by the rows of its
    parts under the separate projections' names (views, in place of the fused entry)."""
    fused = {name: m for name, m in model.named_modules() if isinstance(m, FusedLinear)}
    if not fused:
        return state
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        module_name, _, param_name = key.rpartition(".")
        module = fused.get(module_name)
        if module is None:
            out[key] = tensor
            continue
        parent = module_name.rpartition(".")[0]
        for part, rows in zip(module.parts, tensor.split(list(module.parts.values()), dim=0)):
            out[f"{parent}.{part}.{param_name}"] = rows
    return out


def _state(model: nn.Module, *, keep_vars: bool) -> dict[str, torch.Tensor]:
    """`model.state_dict()` where each fp8 matrix of a rollout model (`rlloom.models.fp8`) appears
    under its unquantized name as an `Fp8Rows` (loading quantizes into it, reading dequantizes)."""
    state = model.state_dict(keep_vars=keep_vars)
    quantized = {name: m for name, m in model.named_modules() if isinstance(m, Fp8Weights)}
    if not quantized:
        return state
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        module_name, _, buffer = key.rpartition(".")
        module = quantized.get(module_name)
        if module is None or buffer not in module.fp8_buffers:
            out[key] = tensor
        elif buffer == module.fp8_buffers[0]:  # the module's matrices, in place of its buffers
            for name, rows in module.fp8_weights().items():
                out[f"{module_name}.{name}"] = rows  # type: ignore[assignment]
    return out


def native_keys(model: nn.Module) -> dict[NativeKey, torch.Tensor]:
    """Every loadable slot of the model: (name, expert) -> the tensor (a view for experts and for
    the parts of fused projections; an `Fp8Rows` for an fp8 matrix)."""
    keys: dict[NativeKey, torch.Tensor] = {}
    for name, tensor in separate_fused(model, _state(model, keep_vars=True)).items():
        rest = _NATIVE_LAYER_RE.match(name)
        if rest is not None and _STACKED_RE.match(rest.group(2)):
            for j in range(tensor.shape[0]):
                keys[(name, j)] = tensor.data[j]
        else:
            keys[(name, None)] = tensor.data
    return keys


def hf_slots(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(hf_name, live slot) for every weight: a view of the parameter, or an `Fp8Rows` (read it with
    `.detach()`) for an fp8 matrix, so that names and shapes cost no dequantization."""
    adapter = StateDictAdapter(model.args)
    for name, tensor in separate_fused(model, _state(model, keep_vars=False)).items():
        yield from adapter.to_hf(name, tensor)


def hf_named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(hf_name, tensor) for every weight of `model` (detached views, model dtype and device; an fp8
    matrix dequantized, one expert at a time)."""
    for name, slot in hf_slots(model):
        yield name, slot.detach()


def load_hf_tensors(model: nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[NativeKey]:
    """Copy HF-named tensors in place into `model`; returns the native keys that were filled."""
    adapter = StateDictAdapter(model.args)
    slots = native_keys(model)
    filled: set[NativeKey] = set()
    fp8_rows: list[tuple[Fp8Rows, torch.Tensor]] = []
    skipped_mtp = 0
    with torch.no_grad():
        for hf_name, tensor in named_tensors:
            if adapter.is_mtp_layer(hf_name):
                skipped_mtp += 1
                continue
            key = adapter.from_hf(hf_name)
            if key is None or key not in slots:
                if hf_name == "lm_head.weight" and model.args.tie_word_embeddings:
                    continue  # a tied checkpoint may still carry a copy of the embedding
                raise CheckpointMismatch(
                    f"unexpected tensor {hf_name!r} with shape {list(tensor.shape)}: it has no place in this "
                    f"{model.args.model_type} model (native name: {key[0] if key else 'none'}). Fix: check that "
                    "config.json matches the weights (layer count, experts, tied embeddings, biases)."
                )
            target = slots[key]
            if tuple(target.shape) != tuple(tensor.shape):
                raise CheckpointMismatch(
                    f"tensor {hf_name!r} has shape {list(tensor.shape)} but the model expects "
                    f"{list(target.shape)} (native {key[0]}{'' if key[1] is None else f'[{key[1]}]'}). "
                    "Fix: check that config.json matches the weights."
                )
            if isinstance(target, Fp8Rows):
                fp8_rows.append((target, tensor))  # quantized together below
            else:
                target.copy_(tensor)
            filled.add(key)
        load_rows(fp8_rows)
    if skipped_mtp:
        logger.info(
            "skipped %d multi-token-prediction tensors (layers >= %d)", skipped_mtp, model.args.num_layers
        )
    return filled


def missing_hf_names(model: nn.Module, filled: set[NativeKey]) -> list[str]:
    """HF names (with expected shapes) of the model slots not in `filled`."""
    adapter = StateDictAdapter(model.args)
    return [
        f"{adapter.hf_name(name, expert)} {list(t.shape)}"
        for (name, expert), t in native_keys(model).items()
        if (name, expert) not in filled
    ]
