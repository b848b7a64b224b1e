"""Activation checkpointing: recompute a decoder layer's activations in backward instead of keeping
them, trading about one extra forward of that layer for its activation memory.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Literal

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from rlloom.models.exact import exact_numerics, is_exact
from rlloom.parallel.layers import decoder_layers, layer_items

ACMode = Literal["off", "full", "every_k"]


def apply_ac(model: nn.Module, mode: ACMode, every_k: int = 1, *, keep_numerics: bool = False) -> int:
    """Wrap decoder layers of `model` (in place) in non-reentrant activation checkpointing.

    mode "off" leaves the model alone, "full" wraps every layer, "every_k" wraps layers 0, k, 2k...
    Apply before FSDP so each checkpointed layer is also one FSDP unit. State-dict keys are
    unchanged (the wrapper strips its own prefix). `keep_numerics`: recompute a layer under the
    forward's exact numerics (`_recompute_as_forward`); for layers that are not compiled (Dynamo
    traces checkpointing's contexts into its graph only for selective checkpointing, and exact runs
    are never compiled). Returns the number of layers wrapped.
    """
    if mode not in ("off", "full", "every_k"):
        raise ValueError(
            f"activation_checkpointing={mode!r} is invalid: must be off, full or every_k. Fix: pick one of those."
        )
    if every_k < 1:
        raise ValueError(
            f"ac_every_k={every_k} is invalid: must be >= 1. Fix: use 2 to checkpoint every other layer."
        )
    if mode == "off":
        return 0
    layers = decoder_layers(model)
    num_wrapped = 0
    for i, (key, layer) in enumerate(layer_items(layers)):
        if mode == "full" or i % every_k == 0:
            # Non-reentrant checkpointing supports keyword arguments (cu_seqlens, max_seqlen) and
            # inputs that do not require grad, which the reentrant variant does not.
            contexts = {"context_fn": _recompute_as_forward} if keep_numerics else {}
            layers[key] = checkpoint_wrapper(layer, **contexts)
            num_wrapped += 1
    return num_wrapped


def _recompute_as_forward() -> tuple[AbstractContextManager, AbstractContextManager]:
    """Checkpointing's contexts, taken at the forward: nothing around the forward, and around its
    recomputation in backward the forward's exact numerics when it ran under them
    (rollout.match_training, models/exact.py). The recomputation then runs the forward's kernels (on
    CUDA the fused autograd Functions of `exact_fused.py`, not the torch formulas), so it saves the
    tensors non-reentrant checkpointing expects and the gradient is taken at the forward's values."""
    return nullcontext(), (_ExactAgain() if is_exact() else nullcontext())


class _ExactAgain(AbstractContextManager):
    """`exact_numerics()` that can be entered more than once: a pipeline schedule that splits the
    backward (zero-bubble: inputs' gradients, then weights') recomputes a checkpointed layer once per
    part, and a generator-based context manager is single-use."""

    def __init__(self) -> None:
        self._open: list[AbstractContextManager] = []

    def __enter__(self) -> None:
        context = exact_numerics()
        context.__enter__()
        self._open.append(context)

    def __exit__(self, *exc: object) -> bool | None:
        return self._open.pop().__exit__(*exc)
