"""How `NativeEngine` (engine.py) readies its parts: the model for decoding (fp8 experts, MoE
inference kernel, this rank's tensor-parallel shard), the EOS ids, the sampler, and whether finished
blocks may serve later requests."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
import torch.distributed as dist

from rlloom.engines.rollout.native.model_runner import ModelRunner
from rlloom.engines.rollout.native.sampler import Sampler
from rlloom.engines.rollout.native.tensor_parallel import TPShards, shard_model, shared_seed
from rlloom.engines.rollout.native.vocab_parallel import VocabParallelSampler
from rlloom.models.fp8 import FP8_NEEDS_EXPERTS, quantize_fp8_
from rlloom.models.moe import use_inference_kernel_


def eos_ids(model: torch.nn.Module) -> list[int]:
    """EOS ids from config.json and, when the model came from a folder, generation_config.json."""
    found: list[int] = []
    sources = [model.hf_config]
    gen_file = Path(model.source_path or "", "generation_config.json")
    if model.source_path and gen_file.is_file():
        sources.append(json.loads(gen_file.read_text()))
    for cfg in sources:
        eos = cfg.get("eos_token_id")
        found += [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return sorted(set(found))


def prepare(model: torch.nn.Module, quantization: str, tp_group: dist.ProcessGroup | None) -> TPShards | None:
    """Ready `model` for decoding in place: fp8 experts (quantization="fp8"; the one check that needs
    the model), the inference kernel for MoE layers, this rank's shard under tensor parallelism
    (returned; None without)."""
    if quantization == "fp8" and quantize_fp8_(model) == 0:
        raise ValueError(
            f"NativeEngine quantization='fp8' is invalid: {FP8_NEEDS_EXPERTS}. Fix: use none for a dense model."
        )
    use_inference_kernel_(model)  # decode's expert products near the memory bound (models/moe.py)
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return None
    assert quantization == "none", "fp8 is not built for tensor-parallel replicas (rollout.quantization)"
    return getattr(model, "tp_shards", None) or shard_model(model, tp_group)


def build_sampler(
    device: torch.device, seed: int | None, tp: TPShards | None, tp_group: dist.ProcessGroup | None
) -> Sampler | VocabParallelSampler:
    """The engine's sampler: seeded at random when `seed` is None, the one seed of every rank of a
    tensor-parallel replica (`shared_seed`), which samples from its vocabulary slice."""
    if tp is None:
        return Sampler(device, seed if seed is not None else random.randrange(2**62))
    return VocabParallelSampler(device, shared_seed(seed, tp_group, device), tp)


def caches_prefixes(runner: ModelRunner) -> bool:
    """Whether finished blocks may serve later requests: not for MoE models (the routes of cached
    positions would be missing). Vision-language models may: blocks are keyed on the pictures too."""
    return runner.route_dtype is None
