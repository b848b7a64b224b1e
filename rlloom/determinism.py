"""Deterministic mode (`trainer.deterministic`): every process of a run computes the same bits from
the same inputs, so two runs of one config, or a run and its kill -9 + resume, are equal on a GPU.

Each process calls `enable_determinism` first thing (the controller in `trainer/run.py`, each Ray
slot actor in its constructor; inline workers share the controller's process), and Ray actors also
get `determinism_env` in their runtime environment, so cuBLAS sees its workspace setting before its
first handle. What it turns on, and why each is needed on CUDA:

- `torch.use_deterministic_algorithms(True)`: torch's ops take their deterministic variants
  (index_add / scatter_add / gather backward / index_select backward by sorting instead of atomics;
  FlashAttention's backward, the one the packed varlen and SDPA paths use, accumulates dQ in a fixed
  order; the memory-efficient SDPA backward runs with one key split; the cuDNN SDPA, which has no
  deterministic backward, is never picked) and raise on an op that has none.
- `CUBLAS_WORKSPACE_CONFIG=:4096:8`: cuBLAS picks reduction strategies by its workspace, which
  otherwise varies with what else runs on the stream (required by the flag above for cuBLAS >= 10.2).
- TF32 off, and no reduced-precision (split-K) reductions for bf16/fp16 GEMMs: cuBLAS's split-K
  choice for a reduced-precision output may depend on the heuristics' state; fp32 accumulation of the
  whole K is one fixed order.
- cuDNN deterministic, its autotuner off (a tuned choice can differ between runs).

The project's own kernels need no switch: the Triton kernels (MoE gather-sum and its backward,
expert GEMMs, logprob head, fp32 gradient accumulation, sampling) use no atomics and a fixed grid for
a given shape; MoE token routing uses gathers, not scatter-adds (models/moe.py); integer counts
(`scatter_add_` of ones) are exact in any order.

A fresh process must round as one that ran the steps before it (a replaced rollout actor, a resumed
run): the rollout's compiled decode forward compiles one graph for every token count, at one fixed
size, in every engine (`compile_decode_forward`, `ModelRunner`), and a replaced rollout replica is
sent every request its lost engine held, those delivered in full too (`cluster/ray_rollout.py`), so
it runs the same batches.

torch's fill of uninitialized memory under deterministic mode is turned off: values read from an
uninitialized buffer here only ever meet an exact zero weight (the KV cache's unused slots under the
attention mask), which a NaN fill would turn into NaN, and nothing else reads one.

What stays timing-dependent: which requests share a rollout batch when they arrive while the engine
runs (later turns of multi-turn episodes, dynamic sampling's extra rounds, the asynchronous modes).
With batch-dependent GEMM kernels a token's logits then depend on that timing; single-turn
`trainer.mode=sync` hands a step's whole batch to the engine at once and is reproducible.
"""

from __future__ import annotations

import os

import torch

from rlloom.config import RunConfig

CUBLAS_WORKSPACE = ":4096:8"
"""cuBLAS's workspace setting for deterministic reductions (`:16:8` is the other valid one)."""


def determinism_env(on: bool) -> dict[str, str]:
    """Environment variables a process of a deterministic run needs before CUDA starts (for Ray
    actors' runtime env); {} when `on` is false."""
    if not on:
        return {}
    current = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    return {"CUBLAS_WORKSPACE_CONFIG": current if current in (":4096:8", ":16:8") else CUBLAS_WORKSPACE}


def enable_determinism(on: bool) -> None:
    """Turn deterministic mode on in this process when `on` (trainer.deterministic); nothing otherwise,
    so the default path keeps torch's fastest kernels."""
    if not on:
        return
    os.environ.update(determinism_env(True))
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False  # see the module docstring
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def timing_caveat(cfg: RunConfig) -> str | None:
    """The warning for a deterministic run whose rollout batches depend on timing (module docstring);
    None when its batches do not, or when the mode is off."""
    timed = [
        name
        for name, on in (
            ("trainer.mode=async", cfg.trainer.mode == "async"),
            ("multi-turn episodes (rollout.env / rollout.tools)", cfg.rollout.multi_turn),
            ("algorithm.dynamic_sampling", cfg.algorithm.dynamic_sampling),
        )
        if on
    ]
    if not cfg.trainer.deterministic or not timed:
        return None
    return (
        f"trainer.deterministic with {', '.join(timed)}: which requests share a rollout batch depends on "
        "timing there, and on a GPU a token's logits depend on its batch, so two runs may still differ "
        "(kernels and updates are deterministic). Single-turn trainer.mode=sync runs repeat bit for bit."
    )
