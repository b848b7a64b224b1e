"""`parallelize`: the one function that turns a native model into its training layout, applying
every technique `ParallelDims` asks for, in a fixed order:

1. TP/SP (`tp.py`) first: its plans address submodules by name and distribute the parameters into
   DTensors, which every later step must see (FSDP shards a DTensor over dp on top of its TP shard).
2. EP (`ep.py`): keeps the local experts and hooks the dispatch/combine around them; after TP,
   because the TP plan decides whether the MoE layer sees token shards (it does when EP runs).
   Context parallelism (`cp.py`) changes no module: the engine shards each micro-batch and hands
   the attention a `CPShard` (the attention backend hook); FSDP shards over dp_shard x cp.
3. Activation checkpointing (`ac.py`) wraps whole decoder layers, hooks included, so a recompute
   replays the TP collectives and the EP all-to-alls in the same order on every rank.
4. torch.compile (`compile.py`) of each (checkpointed) layer, inside FSDP's hooks.
5. FSDP2 (`fsdp.py`) last: it shards whatever parameters the steps above left, experts over the
   ranks that hold the same experts, everything else over dp_shard x cp.

Without `dims` (one process, no process group, fp32) only steps 3 and 4 apply.

Pipeline parallelism (`parallelize_pp`, pp > 1) comes before all of these: the model is cut into
this rank's stage modules first (`pp.apply_pp`), then each stage module is a model of its own to
steps 1-5 (the TP plans skip the parts a stage lacks: the embedding lives on the first stage,
the final norm and head on the last; EP splits the experts of the stage's MoE layers over the
stage's EP ranks; FSDP2 takes the stage module as its root and never reshards after forward: each
micro-batch would gather the layers again). CP cuts each padded micro-batch into equal shares
(`pp_batches.pad_to_budget`). PP composes with FSDP, TP, EP and CP, alone or together.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from rlloom.parallel.ac import ACMode, apply_ac
from rlloom.parallel.compile import apply_compile
from rlloom.parallel.dims import ParallelDims
from rlloom.parallel.ep import apply_ep
from rlloom.parallel.fsdp import apply_fsdp
from rlloom.parallel.pp import Pipeline, apply_pp
from rlloom.parallel.tp import apply_tp


def parallelize(
    model: nn.Module,
    dims: ParallelDims | None,
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype = torch.float32,
    ac_mode: ACMode = "off",
    ac_every_k: int = 1,
    compile_layers: bool = False,
    reshard_after_forward: bool = True,
    root: nn.Module | None = None,
) -> FSDPModule | nn.Module:
    """Parallelise the native `CausalLM` `model` in place over the meshes of `dims` (built).

    `root` is the module FSDP makes its root when it wraps `model` (the training engine's policy
    head); default `model`. Returns the FSDP root (`root` or `model` unsharded when `dims` is None).
    """
    if dims is not None:
        dims.check_model(model.args)
        if dims.pp > 1:
            raise ValueError(
                f"parallelize: pipeline parallelism (pp={dims.pp}) cuts the model into stages. Fix: call "
                "parallelize_pp instead."
            )
    return _apply_in_order(
        model,
        dims,
        root=root if root is not None else model,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        ac_mode=ac_mode,
        ac_every_k=ac_every_k,
        compile_layers=compile_layers,
        reshard_after_forward=reshard_after_forward,
    )


def _apply_in_order(
    model: nn.Module,
    dims: ParallelDims | None,
    *,
    root: nn.Module,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    ac_mode: ACMode,
    ac_every_k: int,
    compile_layers: bool,
    reshard_after_forward: bool,
) -> FSDPModule | nn.Module:
    """Steps 1-5 of the module docstring, in that order, on `model` (a whole model or one pipeline
    stage's), FSDP rooted at `root`; without `dims` only AC and compile (and `root` is returned)."""
    if dims is not None and dims.tp > 1:
        apply_tp(model, dims.tp_mesh(), experts_parallel=dims.ep > 1)
    if dims is not None and dims.ep > 1:
        apply_ep(model, dims.ep_mesh())
    # An uncompiled layer may run under exact numerics (rollout.match_training: never compiled).
    apply_ac(model, ac_mode, ac_every_k, keep_numerics=not compile_layers)
    if compile_layers:
        apply_compile(model)
    if dims is None:
        return root
    return apply_fsdp(
        root,
        dims.dp_shard_mesh(),
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        reshard_after_forward=reshard_after_forward,
        layers_of=model,
        expert_mesh=dims.efsdp_mesh() if dims.ep > 1 else None,
    )


def parallelize_pp(
    model: nn.Module,
    dims: ParallelDims,
    *,
    schedule: str,
    virtual_stages: int,
    first_stage_layers: int,
    last_stage_layers: int,
    budget: int,
    device: torch.device,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype = torch.float32,
    ac_mode: ACMode = "off",
    ac_every_k: int = 1,
    compile_layers: bool = False,
    chunk_tokens: int = 1024,
    value_head: nn.Linear | None = None,
) -> tuple[list[nn.Module], Pipeline]:
    """Cut `model` into this pp rank's stage modules (PP first), then TP/SP (tp > 1), EP (ep > 1),
    AC, compile and FSDP2 over dp_shard x cp on each; returns the FSDP-wrapped stage modules and the
    `Pipeline` that runs them. Under TP (CP) the stages exchange each TP (CP) rank's token share (`pp.py`).
    `value_head`: the critic's value head, run by the last stage in place of the logprob head."""
    dims.check_model(model.args)

    def parallelize_stage(stage: nn.Module) -> nn.Module:
        return _apply_in_order(
            stage.model,
            dims,
            root=stage,
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            ac_mode=ac_mode,
            ac_every_k=ac_every_k,
            compile_layers=compile_layers,
            reshard_after_forward=False,
        )

    stages, pipe = apply_pp(
        model,
        dims.pp_mesh(),
        schedule=schedule,
        budget=budget,
        device=device,
        dtype=param_dtype,
        virtual_stages=virtual_stages,
        first_stage_layers=first_stage_layers,
        last_stage_layers=last_stage_layers,
        chunk_tokens=chunk_tokens,
        parallelize_stage=parallelize_stage,
        value_head=value_head,
        tp=dims.tp,
        ep_group=dims.ep_mesh().get_group() if dims.ep > 1 else None,
        cp_group=dims.cp_mesh().get_group() if dims.cp > 1 else None,
    )
    pipe.feed.tp_rank = dims.tp_mesh().get_local_rank()  # the token shard its MoE layers route
    return stages, pipe
