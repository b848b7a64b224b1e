"""A family's tensor-parallel plan, written once as data: which module of a decoder layer is split how
over the ranks of a TP group. Training (rlloom/parallel/tp.py: DTensor styles, sequence parallel) and
rollout (engines/rollout/native/tensor_parallel.py: each rank cut down to its shard in place) both read
the family's plan (`Family.tp`) and each turns a `Split` into its own mechanism; neither names a
module of a layer. The pieces below are the plans of the building blocks several families share; a
family composes them (as it composes its weight names) and writes what is its own.

The embedding, the final norm and the lm head are the same for every family (vocabulary-parallel
rows of the [V, D] weights) and stay with each engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum

from torch import nn


class Split(Enum):
    """How one module of a decoder layer is laid out over the TP ranks (Megatron-LM's scheme)."""

    COLUMN = "column"
    """Output features split evenly: whole heads (attention) or a slice of the MLP width. The
    block's input is all-gathered over the token shards first (training's sequence parallelism);
    the rollout cuts a fused projection's parts alike."""
    KV_COLUMN = "kv_column"
    """GQA's k/v: COLUMN, except that a rollout with more ranks than KV heads keeps on each rank the
    one KV head its query heads read (training needs tp to divide the KV heads)."""
    ROW = "row"
    """Input features split; the partial outputs are summed (training: reduce-scattered onto the
    token shards; rollout: one all-reduce, or none inside an MoE layer, which sums once at its end)."""
    REPLICATED = "replicated"
    """Whole on every rank, run on the gathered input (MLA's low-rank q_a/kv_a and their norms)."""
    SHARED_KEY = "shared_key"
    """MLA's kv_a: REPLICATED, and the trailing `qk_rope_head_dim` output columns (the rope key that
    every head of every rank reads) get their gradient summed over the TP ranks in training."""
    HEAD_NORM = "head_norm"
    """A norm over each local head's features (QK-norm): a replicated weight, its gradient summed
    over the ranks' heads in training."""
    TOKEN_NORM = "token_norm"
    """A norm between blocks: training runs it on the token shards (sequence parallel); the rollout
    keeps it whole."""
    EXPERTS = "experts"
    """An MoE layer. Training keeps its parameters whole on every TP rank and runs it on all tokens
    of the group (or, with expert parallelism borrowing the TP ranks, routes each rank's token shard
    to the experts); the rollout splits every expert's width like the dense `MLP` (gate/up rows,
    down columns), keeps the router whole, splits the shared experts like `MLP` and all-reduces once
    after routed + shared are combined."""


LayerPlan = Mapping[str, Split]
"""Module path inside a decoder layer (`attention.wq`) -> its Split. A plan names every module the
family's layers can hold; a layer without one (no QK-norm, a dense layer of an MoE model) skips it."""

COLUMN, KV_COLUMN, ROW = Split.COLUMN, Split.KV_COLUMN, Split.ROW

NORMS_TP: LayerPlan = {"attention_norm": Split.TOKEN_NORM, "ffn_norm": Split.TOKEN_NORM}
GQA_TP: LayerPlan = {
    "attention.wq": COLUMN,
    "attention.wk": KV_COLUMN,
    "attention.wv": KV_COLUMN,
    "attention.wo": ROW,
}
QK_NORM_TP: LayerPlan = {"attention.q_norm": Split.HEAD_NORM, "attention.k_norm": Split.HEAD_NORM}
"""Qwen3's norms over each head of q and k [N, local heads, head_dim]."""
MLP: LayerPlan = {"w1": COLUMN, "w3": COLUMN, "w2": ROW}
"""The SwiGLU MLP (gate w1, up w3, down w2), relative to the MLP: the dense layer's and, in the
rollout, the shared experts' and every routed expert's."""
DENSE_MLP_TP: LayerPlan = {f"feed_forward.{name}": split for name, split in MLP.items()}
MOE_TP: LayerPlan = {"moe": Split.EXPERTS}


def held(layer: nn.Module, path: str) -> nn.Module | None:
    """The module at `path` inside `layer`, or None where this layer has none (no QK-norm, the dense
    MLP of a sparse layer, MLA's `wq` beside q-LoRA)."""
    try:
        return layer.get_submodule(path)  # raises for a missing module or one held as None
    except AttributeError:
        return None
