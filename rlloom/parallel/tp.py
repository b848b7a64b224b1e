"""Tensor and sequence parallelism (Megatron-LM, Shoeybi et al. 2019; Korthikanti et al. 2022) as
DTensor plans. What is split how is the model family's plan (`Family.tp`, rlloom/models/families/
tp_plan.py), which the rollout's tensor parallelism reads too; this module turns each `Split` into a
DTensor style (`_style`).

Layout of the residual stream (the packed [N, D] stream the training engine runs; N must be a
multiple of tp): sharded over tokens (Shard(0), "sequence parallel") between blocks, where only
per-token work happens (norms, residual adds). Before attention and the MLP the tokens are
all-gathered; q/k/v and gate/up are column-wise (each rank holds whole heads / a slice of the MLP
width), the output and down projections row-wise, and their partial sums are reduce-scattered back
onto the token shards. The embedding and the lm head are sharded over the vocabulary (Shard(0) of
the [V, D] weight); the head never gathers full logits (see `vocab_parallel.py`).

What the splits need beyond a torch style:
- HEAD_NORM (Qwen3's QK-norms) runs on the local heads with a replicated weight whose gradient is
  summed over the TP ranks.
- EXPERTS: the MoE layer runs on all tokens of the TP group with replicated weights, or, when
  expert parallelism (`ep.py`) borrows the TP ranks, each rank routes its own token shard to the
  experts (never split within an expert) and the router's and shared experts' gradients are summed
  over TP.
- SHARED_KEY (DeepSeek-V3's kv_a): the rope key k_pe comes out of kv_a and is shared by every head,
  so its gradient is a partial sum over the TP ranks' heads: the kv_a output all-reduces that slice
  of its gradient. The low-rank q_a/kv_a and their norms are REPLICATED, q_b/kv_b column-wise.

`apply_tp(model, tp_mesh)` distributes the parameters in place and sets each attention module's
head counts to its local heads. Only the training form of the model is supported (separate
projections, `fused_projections=False`).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import _functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from rlloom.models.args import ModelArgs
from rlloom.models.families import FAMILIES
from rlloom.models.families.tp_plan import LayerPlan, Split, held
from rlloom.models.lora import LoRALinear
from rlloom.parallel.layers import decoder_layers, layer_items

TOKENS = Shard(0)
"""Sequence-parallel placement of the packed [N, D] stream."""


class Replicated(ParallelStyle):
    """Replicate a module's parameters over the TP mesh and run it on the replicated input (every
    rank computes the same thing); its gradients are complete because whatever consumes the output
    (a column-wise projection) all-reduces the gradient it sends back."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def to_dtensor(_module, inputs, mesh):  # noqa: ANN001, ANN202
            return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs)

        def to_local(_module, output, _mesh):  # noqa: ANN001, ANN202
            return output.to_local()

        return distribute_module(module, device_mesh, input_fn=to_dtensor, output_fn=to_local)


class _AllReduceGradTail(torch.autograd.Function):
    """Identity forward; backward all-reduces columns [start:] of the gradient over `group`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, start: int, group: dist.ProcessGroup) -> torch.Tensor:  # noqa: ANN001
        ctx.start, ctx.group = start, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        # A functional (out-of-place) all-reduce: inside a layer compiled by torch 2.11, a backward
        # made of in-place c10d calls delivered no gradient (context parallelism's K/V all-gather).
        tail = funcol.wait_tensor(funcol.all_reduce(grad[..., ctx.start :].contiguous(), "sum", ctx.group))
        return torch.cat([grad[..., : ctx.start], tail], dim=-1), None, None


class ReplicatedSharedKey(Replicated):
    """MLA's kv_a: replicated, and the trailing `width` output columns (the rope key shared by the
    heads of every TP rank) get their gradient summed over the TP ranks. The leading columns (the
    latent) need no sum: kv_b, column-wise, already all-reduces the gradient it returns."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width = width

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        start, group = module.out_features - self.width, device_mesh.get_group()
        module.register_forward_hook(lambda _m, _inputs, out: _AllReduceGradTail.apply(out, start, group))
        return module


class GatherTokens(ParallelStyle):
    """All-gather a block's first input (the token shards) before the block runs; its other inputs
    (rope tables, the attention layout) pass as they are."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(_module: nn.Module, args: tuple) -> tuple:
            x, *rest = args
            return (_token_shards(x, device_mesh).redistribute(device_mesh, [Replicate()]).to_local(), *rest)

        module.register_forward_pre_hook(gather)
        return module


def _token_shards(x: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """The packed stream as the DTensor of its token shards (`x` this rank's shard, or already one)."""
    return x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [TOKENS], run_check=False)


class MoETokens(ParallelStyle):
    """The MoE layer's inputs and output under TP (its parameters stay plain and replicated).

    Without expert parallelism all tokens of the TP group go through the whole MoE layer on every
    TP rank (the token shards are all-gathered), then each rank keeps its shard: the weights see the
    same tokens and gradients everywhere. With it (EP borrows the TP ranks, dims.py) each rank routes
    its own token shard and the experts' all-to-all brings every expert its tokens from all of them;
    the router and shared experts then see only this rank's tokens, and `apply_tp` sums their
    gradients over TP. The rollout's routes (routing replay, [N, K] for the whole stream, the same
    on every TP rank) are passed whole or cut to the rank's shard to match.
    """

    def __init__(self, experts_parallel: bool) -> None:
        super().__init__()
        self.experts_parallel = experts_parallel

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        rank = device_mesh.get_local_rank()

        def inputs_fn(_module: nn.Module, args: tuple) -> tuple:
            x, *rest = args
            if not self.experts_parallel:
                return (
                    _token_shards(x, device_mesh).redistribute(device_mesh, [Replicate()]).to_local(),
                    *rest,
                )
            x = _token_shards(x, device_mesh).to_local()
            if rest and rest[0] is not None:
                rest[0] = rest[0][rank * x.shape[0] : (rank + 1) * x.shape[0]]
            return (x, *rest)

        def output_fn(_module: nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
            if self.experts_parallel:
                return out
            full = DTensor.from_local(out, device_mesh, [Replicate()], run_check=False)
            return full.redistribute(device_mesh, [TOKENS]).to_local()

        module.register_forward_pre_hook(inputs_fn)
        module.register_forward_hook(output_fn)
        return module


def _held(args: ModelArgs, layer: nn.Module) -> LayerPlan:
    """The entries of the layer's family plan (`Family.tp`) for the modules this layer holds."""
    plan = FAMILIES[args.model_type].tp
    return {path: split for path, split in plan.items() if held(layer, path) is not None}


def _style(split: Split, args: ModelArgs, experts_parallel: bool) -> ParallelStyle:
    """The DTensor style of one `Split` (the token stream between blocks on Shard(0))."""
    match split:
        case Split.COLUMN | Split.KV_COLUMN:
            return ColwiseParallel()
        case Split.ROW:
            return RowwiseParallel(output_layouts=TOKENS)
        case Split.REPLICATED:
            return Replicated()
        case Split.SHARED_KEY:
            assert args.mla is not None
            return ReplicatedSharedKey(args.mla.qk_rope_head_dim)
        case Split.HEAD_NORM:  # [N, local heads, head_dim]: a replicated weight over sharded heads
            return SequenceParallel(sequence_dim=1, use_local_output=True)
        case Split.TOKEN_NORM:
            return SequenceParallel(sequence_dim=0)
        case Split.EXPERTS:
            return MoETokens(experts_parallel)
    raise AssertionError(split)


def layer_plan(args: ModelArgs, held: LayerPlan, experts_parallel: bool = False) -> dict[str, ParallelStyle]:
    """The DTensor plan of one decoder layer (keys relative to it) from the entries of its family's
    plan that the layer holds (`_held`): each block whose modules the plan names (attention, the
    dense MLP) gathers its token shards first. `experts_parallel` when `ep.apply_ep` splits the
    experts over ranks that include the TP ranks."""
    blocks = {path.rpartition(".")[0] for path in held} - {""}
    plan: dict[str, ParallelStyle] = {block: GatherTokens() for block in sorted(blocks)}
    return plan | {path: _style(split, args, experts_parallel) for path, split in held.items()}


def _after_plan(layer: nn.Module, held: LayerPlan, tp_mesh: DeviceMesh, experts_parallel: bool) -> None:
    """What a split layer needs beyond its styles: a block with column-split heads counts its local
    heads (the model reshapes its projections into them); with expert parallelism an MoE layer's
    router and shared experts sum their gradients over the TP ranks (`MoETokens`)."""
    split_blocks = {
        path.rpartition(".")[0] for path, how in held.items() if how in (Split.COLUMN, Split.KV_COLUMN)
    }
    for block in map(layer.get_submodule, split_blocks - {""}):
        for heads in ("num_heads", "num_kv_heads"):
            if hasattr(block, heads):
                setattr(block, heads, getattr(block, heads) // tp_mesh.size())
    for path, how in held.items():
        if experts_parallel and how is Split.EXPERTS:
            moe = layer.get_submodule(path)
            _sum_grads_over(moe, tp_mesh.get_group(), skip=moe.experts)


def root_plan(args: ModelArgs, model: nn.Module) -> dict[str, ParallelStyle]:
    """Embedding (vocabulary-sharded, output on token shards), final norm and lm head weight, those
    of them `model` holds (a pipeline stage has the embedding, the norm and head, or none)."""
    plan: dict[str, ParallelStyle] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=TOKENS),
        "norm": SequenceParallel(sequence_dim=0),
    }
    if not args.tie_word_embeddings:
        # Only the [V, D] weight's vocabulary sharding matters: the head reads the weight directly.
        plan["output"] = ColwiseParallel()
    return {name: style for name, style in plan.items() if getattr(model, name, None) is not None}


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, experts_parallel: bool = False) -> nn.Module:
    """Tensor-parallelise a native `CausalLM` (or a pipeline stage's `StageModel`: layers in a
    ModuleDict keyed by their index in the whole model, parts it lacks None) over the 1-D `tp_mesh`
    in place; returns it.

    The parameters become DTensors (sharded or replicated over `tp_mesh`); the MoE layers keep
    plain replicated parameters. `model.hidden_states` then returns token shards (a DTensor
    Shard(0) of the packed stream), which `vocab_parallel.vocab_parallel_token_logprobs` turns into
    logprobs without gathering full logits. With `experts_parallel` (apply `ep.apply_ep` next, on
    an EP mesh that holds the TP ranks) each TP rank routes only its own token shard.
    """
    args: ModelArgs = model.args
    if args.fused_projections:
        raise ValueError(
            "apply_tp: the model has fused_projections=True (the rollout layout); tensor parallelism "
            "shards the separate q/k/v and gate/up projections. Fix: load the training form of the model."
        )
    tp = tp_mesh.size()
    for name, value in (("num_attention_heads", args.num_heads), ("num_key_value_heads", args.num_kv_heads)):
        if value % tp:
            raise ValueError(
                f"apply_tp: tp={tp} does not divide {name}={value}. Fix: use a tp that divides it."
            )
    trainable = {name: p.requires_grad for name, p in model.named_parameters()}
    parallelize_module(model, tp_mesh, root_plan(args, model))
    for _, layer in layer_items(decoder_layers(model)):
        held = _held(args, layer)
        parallelize_module(layer, tp_mesh, layer_plan(args, held, experts_parallel))
        _place_adapters(layer, tp_mesh)
        _after_plan(layer, held, tp_mesh, experts_parallel)
    for name, param in model.named_parameters():
        # torch's parallel styles wrap what they distribute as new, trainable parameters: LoRA's
        # frozen base (and a frozen reference) must stay frozen
        param.requires_grad_(trainable[name])
        if isinstance(param, DTensor) and param.requires_grad:  # a frozen reference has no gradients
            param.register_post_accumulate_grad_hook(_grad_like_param)
    # On the embedding: `forward` and `hidden_states` both start there (a pipeline's middle and
    # last stages have none: the pipeline's budget is checked against tp when it is built).
    if model.tok_embeddings is not None:
        model.tok_embeddings.register_forward_pre_hook(partial(_check_divisible, tp=tp))
    return model


def _check_divisible(_embedding: nn.Module, args: tuple, *, tp: int) -> None:
    input_ids = args[0]
    if input_ids.shape[0] % tp:
        raise ValueError(
            f"tensor parallelism splits the {input_ids.shape[0]} tokens of the packed stream (input_ids "
            f"{tuple(input_ids.shape)}) into tp={tp} equal shards, and {input_ids.shape[0]} is not a multiple "
            f"of {tp}. Fix: pad the stream to a multiple of {tp} tokens (e.g. a padding sequence at the end)."
        )


def _sum_grads_over(module: nn.Module, group: dist.ProcessGroup, skip: nn.Module) -> None:
    """Sum each incoming gradient of `module`'s parameters (except `skip`'s) over `group`, before it
    is accumulated (so micro-batch accumulation stays exact).

    The hooks go on the parameters the module holds when its forward starts: FSDP2 swaps in its
    unsharded parameters there (one object per parameter, reused every step), and those are the
    tensors autograd accumulates into; hooks on the original parameters would never fire."""
    hooked: set[int] = set()

    def hook_params(mod: nn.Module, _inputs: tuple) -> None:
        skipped = {id(p) for p in skip.parameters()}
        for param in mod.parameters():
            if id(param) not in skipped and id(param) not in hooked and param.requires_grad:
                hooked.add(id(param))
                param.register_hook(lambda grad: _all_reduced(grad, group))

    module.register_forward_pre_hook(hook_params)


def _all_reduced(grad: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    grad = grad.clone()
    dist.all_reduce(grad, group=group)
    return grad


def _place_adapters(layer: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Lay out the LoRA adapters (`models/lora.py`) of the layer's tensor-parallel projections like
    their weight W [out, in]: column-wise (W sharded on out) A [r, in] is replicated and B [out, r]
    sharded on out, so each rank adds the update of its own output columns; row-wise (W sharded on
    in) A is sharded on in and B replicated, so the update is a partial sum that the projection's
    reduce-scatter adds up with W's; beside a replicated W both are replicated. (ColwiseParallel
    shards every parameter of the module on dim 0, A's rank too; RowwiseParallel leaves them
    plain.) The gradients DTensor leaves partial (A's column-wise, B's row-wise) are summed by
    `_grad_like_param` and FSDP2."""
    for module in layer.modules():
        if not isinstance(module, LoRALinear) or not isinstance(module.weight, DTensor):
            continue
        (placement,) = module.weight.placements
        if placement == Shard(0):
            layouts = {"lora_A": Replicate(), "lora_B": Shard(0)}
        elif placement == Shard(1):
            layouts = {"lora_A": Shard(1), "lora_B": Replicate()}
        else:
            layouts = {"lora_A": Replicate(), "lora_B": Replicate()}
        for name, want in layouts.items():
            param = getattr(module, name)
            full = param.full_tensor() if isinstance(param, DTensor) else param
            placed = distribute_tensor(full.detach(), tp_mesh, [want])
            module.register_parameter(name, nn.Parameter(placed, requires_grad=param.requires_grad))


def _grad_like_param(param: DTensor) -> None:
    """Give a gradient its parameter's placements once it is accumulated.

    DTensor's backward leaves some gradients in another layout than their parameter: the weight of
    a sequence-parallel norm gets a Partial (per-rank partial sums over its token shard), the
    embedding a Replicate. Optimizers and `grad_norm` read the local gradient as if it had the
    parameter's layout, so the partial sums are all-reduced (and a replicated gradient sliced) here.
    FSDP2 does the same before its reduce-scatter for the parameters it owns.
    """
    grad = param.grad
    if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(param.placements):
        param.grad = grad.redistribute(param.device_mesh, param.placements)
