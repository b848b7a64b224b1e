"""LoRA (Hu et al. 2021): low-rank adapters on the decoder's linear projections, the rest frozen.

`apply_lora(model, rank=r, alpha=a, targets=...)` turns each targeted `nn.Linear` of the decoder
layers into a `LoRALinear` in place: the same module with its `weight` (and bias) frozen and two
trainable matrices beside it, `lora_A` [r, in] (Kaiming-uniform, as PEFT) and `lora_B` [out, r]
(zero, so the model starts as the base model). Its output is x W^T + (a / r) (x A^T) B^T. The
module keeps its name and its `weight`, so state-dict names, FSDP and checkpoints see the base
model plus `*.lora_A` / `*.lora_B`; `merged_state(model)` gives the base names with W + (a / r) B A
(in W's dtype), which the weight sync and the Hugging Face export take (the rollout engine never
sees adapters).

Targets are Hugging Face projection names (`q_proj`, `k_proj`, `v_proj`, `o_proj`, `gate_proj`,
`up_proj`, `down_proj`, DeepSeek-V3's MLA projections) or `all-linear`: every projection of the
attention and the dense (and shared-expert) MLPs. Routed experts, routers, embeddings and the lm
head stay frozen without adapters.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from rlloom.config import ConfigError
from rlloom.models.model import unwrapped_name

HF_TARGETS = {  # keyed by config's LORA_TARGET_NAMES
    "q_proj": "wq",
    "k_proj": "wk",
    "v_proj": "wv",
    "o_proj": "wo",
    "gate_proj": "w1",
    "up_proj": "w3",
    "down_proj": "w2",
    "q_a_proj": "wq_a",
    "q_b_proj": "wq_b",
    "kv_a_proj_with_mqa": "wkv_a",
    "kv_b_proj": "wkv_b",
}
"""Hugging Face projection name -> the native module name it targets."""
ALL_LINEAR = "all-linear"
LORA_PARAMS = (".lora_A", ".lora_B")
"""State-dict name endings of the adapters."""


class LoRALinear(nn.Linear):
    """An `nn.Linear` with a frozen weight and a trainable low-rank update (see the module docstring)."""

    lora_A: nn.Parameter
    lora_B: nn.Parameter
    scaling: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The scaling goes on B ([out, r]) and the GEMM adds the update itself (addmm, beta 1): at
        # 270k tokens a step, an [N, out] product scaled and added in passes of their own costs
        # more than the adapters' FLOPs.
        out = F.linear(x, self.weight, self.bias)
        down = F.linear(x, self.lora_A)
        up = (self.lora_B * self.scaling).t()
        return torch.addmm(out.reshape(-1, out.shape[-1]), down.reshape(-1, down.shape[-1]), up).view(
            out.shape
        )

    def merged_weight(self) -> torch.Tensor:
        """W + scaling x B A in W's dtype and W's layout: one GEMM adds the update to the weight
        (accumulated in fp32, rounded once), B and A in W's dtype as the forward computes with them.
        A sharded W stays sharded (DTensor gathers only what the product needs, A's few rows), so
        the weight sync gathers the merged weight as it gathers any parameter. (Gathering W, A and
        B and merging in fp32 moved about 5x the bytes, every step.)"""
        weight = self.weight.detach()
        down, up = self.lora_A.detach().to(weight.dtype), self.lora_B.detach().to(weight.dtype)
        merged = torch.addmm(weight, up, down, alpha=self.scaling)
        if isinstance(merged, DTensor) and merged.placements != weight.placements:
            merged = merged.redistribute(weight.device_mesh, weight.placements)  # W's layout exactly
        return merged


def parse_targets(targets: str) -> set[str] | None:
    """The native module names `targets` (a `train.lora_target_modules` value, checked by the
    config) names; None for all."""
    if targets.strip() == ALL_LINEAR:
        return None
    return {HF_TARGETS[t.strip()] for t in targets.split(",") if t.strip()}


def _targeted(model: nn.Module, native: set[str] | None) -> Iterator[tuple[str, nn.Linear]]:
    """(qualified name, module) of the decoder layers' attention and dense-MLP projections."""
    wanted = set(HF_TARGETS.values()) if native is None else native
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        inside = (
            ".attention." in f".{name}" or ".feed_forward." in f".{name}" or ".shared_experts." in f".{name}"
        )
        if type(module) is nn.Linear and leaf in wanted and name.startswith("layers.") and inside:
            yield name, module


def apply_lora(model: nn.Module, *, rank: int, alpha: float, targets: str = ALL_LINEAR, seed: int = 0) -> int:
    """Freeze `model` (a native CausalLM, unsharded) and add LoRA adapters to the targeted
    projections in place (see the module docstring); returns how many modules got one. The
    adapters' initial values come from `seed` alone (every rank of a sharded engine gets the same)."""
    modules = list(_targeted(model, parse_targets(targets)))
    if not modules:
        raise ConfigError(
            f"train.lora_target_modules={targets!r} is invalid: it matches no projection of this "
            f"{model.args.model_type} model. Fix: use all-linear, or names this model has (q_proj, ... for "
            "grouped-query attention; q_a_proj, kv_b_proj, ... for DeepSeek-V3's MLA)."
        )
    model.requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)
    for _, module in modules:
        weight = module.weight
        a = torch.empty(rank, module.in_features, dtype=torch.float32)
        bound = 1.0 / math.sqrt(module.in_features)  # kaiming_uniform_(a=sqrt(5)), PEFT's default
        a.uniform_(-bound, bound, generator=gen)
        module.__class__ = LoRALinear
        module.lora_A = nn.Parameter(a.to(weight.device, weight.dtype))
        module.lora_B = nn.Parameter(
            torch.zeros(module.out_features, rank, dtype=weight.dtype, device=weight.device)
        )
        module.scaling = alpha / rank
    return len(modules)


def merged_state(state: dict[str, torch.Tensor], model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """`state` (the model's state dict, names as `model.state_dict()`'s) with each adapted weight
    merged (W + scaling x B A, in the weight's layout: sharded where it is) and the adapters left
    out; other tensors as they are. Collective when sharded: every rank must consume it."""
    adapted = adapted_weights(model)
    for name, tensor in state.items():
        if name.endswith(LORA_PARAMS):
            continue
        module = adapted.get(name)
        yield name, (module.merged_weight() if module is not None else tensor)


def adapted_weights(model: nn.Module) -> dict[str, LoRALinear]:
    """The adapted modules of `model` by their weight's state-dict name (wrapper prefixes stripped)."""
    return {f"{unwrapped_name(n)}.weight": m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def has_lora(model: nn.Module) -> bool:
    return any(isinstance(m, LoRALinear) for m in model.modules())
