"""Where a model keeps its decoder layers: the unit that FSDP shards and activation checkpointing
recomputes. Native models expose them as `model.layers` (an nn.ModuleList or nn.ModuleDict).
"""

from __future__ import annotations

from torch import nn


def decoder_layers(model: nn.Module) -> nn.ModuleList | nn.ModuleDict:
    """The container of `model`'s decoder layers (`model.layers`), so entries can be replaced."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList | nn.ModuleDict):
        raise ValueError(
            f"{type(model).__name__} has no `layers` ModuleList/ModuleDict of decoder layers (found "
            f"{type(layers).__name__}); parallelisms wrap each decoder layer. Fix: pass a native rlloom "
            "model (rlloom.models.from_pretrained) or expose its blocks as `model.layers`."
        )
    return layers


def layer_items(layers: nn.ModuleList | nn.ModuleDict) -> list[tuple[str | int, nn.Module]]:
    """(key, layer) pairs in order, keys usable with `layers[key] = new_layer`."""
    if isinstance(layers, nn.ModuleDict):
        return list(layers.items())
    return list(enumerate(layers))
