"""FSDP2 data parallelism: shard every decoder layer, then the root (embeddings, final norm, head).

Parameters stay in their dtype (fp32 master weights); compute runs in `param_dtype` and gradients
are reduced in `reduce_dtype`. Gradients are SUMMED over data-parallel ranks, not averaged: the
training engine divides each rank's loss by the normaliser of the global batch, so the sum over
ranks is already the global batch's gradient.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from rlloom.parallel.layers import decoder_layers, layer_items


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: bool = True,
    layers_of: nn.Module | None = None,
    expert_mesh: DeviceMesh | None = None,
) -> FSDPModule:
    """Shard `model` over `dp_mesh` (1-D: FSDP, 2-D (replicate, shard): HSDP) in place.

    `layers_of` is the module holding `.layers` when `model` wraps it (default: `model` itself).
    `reshard_after_forward=False` keeps the decoder layers gathered between forward and backward
    (ZeRO-2 style: more memory, fewer all-gathers). With expert parallelism (`ep.apply_ep`), each
    layer's local experts are sharded over `expert_mesh` (the ranks holding the same experts,
    `ParallelDims.efsdp_mesh()`) first, as a unit of their own. Returns `model`, now an FSDPModule.
    """
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # The experts' inputs include the fp32 routing weights, which the combine saves for backward:
    # FSDP's cast of forward inputs would make them bf16 in the forward but not in an activation
    # checkpoint's recompute (FSDP skips its pre-forward there), a CheckpointError on GPUs (ep=2,
    # activation_checkpointing=full). The tokens arrive in the compute dtype already.
    experts_policy = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False
    )
    layers = decoder_layers(layers_of if layers_of is not None else model)
    for _, layer in layer_items(layers):
        moe = getattr(layer, "moe", None)
        if expert_mesh is not None and moe is not None:
            # Summed over expert_mesh like everything else: a local expert's gradient already holds
            # every token its EP group routed to it, so the sum over the groups is the global one.
            fully_shard(
                moe.experts,
                mesh=expert_mesh,
                mp_policy=experts_policy,
                reshard_after_forward=reshard_after_forward,
            )
        fully_shard(layer, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    # The root's parameters (embedding, head) are needed again right at the start of backward, so
    # they stay gathered between forward and backward; call `model.reshard()` after a forward-only pass.
    fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=False)
    # Ranks may leave different parameters unused in a backward (an empty micro-batch, MoE experts
    # no token reached); zero gradients for them keep every rank's reduce-scatter the same size.
    # (torch < 2.12 has no such switch; there, dense models are fine and MoE needs every expert used.)
    if hasattr(model, "set_reduce_scatter_unused_params"):
        model.set_reduce_scatter_unused_params(True)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # Divide by 1 = sum. Forcing plain SUM collectives (no NCCL PreMulSum) also makes the
            # same code path run on gloo, which has no pre-multiplied sum.
            module.set_gradient_divide_factor(1.0)
            if hasattr(module, "set_force_sum_reduction_for_comms"):
                module.set_force_sum_reduction_for_comms(True)
    assert isinstance(model, FSDPModule)
    return model
