"""torch.compile per decoder layer: fuses the memory-bound elementwise work (RMSNorm, RoPE, SwiGLU,
dtype casts) that otherwise costs as much device time as the matmuls.

Each layer is compiled in place (`nn.Module.compile`), so parameter names and state-dict keys do not
change. Applied after activation checkpointing and before FSDP (torchtitan's order): the compiled
region is then the checkpointed layer, and FSDP's hooks stay outside it. Shapes are dynamic because
every micro-batch packs a different number of tokens. The compiled code is cached on disk
(`rlloom.compile_cache`), so a later run of the same code and shapes skips Inductor's compilation.
"""

from __future__ import annotations

from torch import nn

from rlloom.compile_cache import enable_compile_cache
from rlloom.parallel.layers import decoder_layers, layer_items


def apply_compile(model: nn.Module) -> int:
    """Compile every decoder layer of `model` in place; returns how many were compiled."""
    enable_compile_cache()
    layers = decoder_layers(model)
    items = layer_items(layers)
    for _, layer in items:
        layer.compile(dynamic=True)
    return len(items)
