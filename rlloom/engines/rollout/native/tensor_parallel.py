"""Tensor parallelism of one rollout engine: `shard_model` cuts a loaded (fused) CausalLM down to the
part one rank of a `rollout.tp` group runs, in place; `TPShards` records what each rank holds.

Which module of a decoder layer splits how is the model family's plan (`Family.tp`, rlloom/models/
families/tp_plan.py), the one training's tensor parallelism reads too; `_Sharder.block` turns each
`Split` into a cut. The Megatron scheme (nano-vllm `layers/linear.py` and `layers/embed_head.py`
follow it too), as the families' plans give it:
- attention: the fused q/k/v projection is column-parallel by heads (rank r keeps query heads
  [r Hq/tp, (r+1) Hq/tp) and their KV heads), the output projection row-parallel with ONE all-reduce.
  With tp > Hkv each rank keeps the one KV head its query heads read (KV heads replicated tp / Hkv
  times; tp must then be a multiple of Hkv). The KV cache of a rank holds its heads only.
  DeepSeek-V3 MLA (the training form the engine runs: k/v expanded per head) splits the same way:
  q (or q_b) and kv_b by heads, the latent projections q_a / kv_a and their norms replicated.
- MLP: the fused gate/up projection column-parallel, down row-parallel with ONE all-reduce.
- Qwen3-MoE / DeepSeek-V3 experts: every expert's intermediate width is split (w1/w3 rows, w2
  columns), the router and its scores replicated (every rank routes every token identically), shared
  experts split the same way, and the MoE layer all-reduces ONCE after routed + shared are combined.
  Expert parallelism would move tokens between ranks instead; at decode batch sizes the all-reduce
  of a [tokens, hidden] activation is smaller than the dispatch and combine all-to-alls.
- embedding and lm head: vocabulary-parallel, rank r holds rows [r Vp, r Vp + Vp) of a vocabulary
  padded to tp * Vp (Vp a multiple of 4, so the sampler's noise quads line up); the embedding
  all-reduces its masked lookup, the head returns this rank's logits columns (vocab_parallel.py
  samples from them).

The sharded model's `args` count this rank's heads (num_heads, num_kv_heads), which is what the KV
cache and the attention kernels need; vocab_size and every other field stay the full model's.

Weights: `TPShards.slices` maps every loadable native key to a `Shard` (the dim a full tensor is cut
on and this rank's range), or nothing for a replicated tensor; tp_weights.py loads and updates the
shards.

Shape legend: Hq/Hkv heads, D head dim, I intermediate width, V vocabulary, Vp rows per rank.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from rlloom.engines.rollout.native.tp_layers import ReducedMoE, RowParallelLinear, VocabParallelEmbedding
from rlloom.models.args import ModelArgs
from rlloom.models.families import FAMILIES
from rlloom.models.families.tp_plan import MLP, LayerPlan, Split, held
from rlloom.models.layers import FusedLinear
from rlloom.models.moe import MoE


@dataclass(frozen=True, slots=True)
class Shard:
    """The part of one full tensor a rank holds: `length` entries from `start` along `dim`."""

    dim: int
    start: int
    length: int


@dataclass(slots=True)
class TPShards:
    """What this rank of a tensor-parallel rollout engine holds."""

    group: dist.ProcessGroup
    rank: int
    size: int
    full_args: ModelArgs
    """The unsharded model's hyper-parameters."""
    vocab_start: int
    """First vocabulary id of this rank's embedding rows and logits columns."""
    vocab_rows: int
    """Rows per rank (Vp): the logits have this many columns; ids >= vocab_size are padding."""
    slices: dict[str, Shard | None]
    """Native parameter name -> this rank's `Shard` of it (None: replicated); for stacked experts the
    Shard of each expert's own [I, D] (gate, up) or [D, I] (down) tensor."""

    @property
    def vocab_valid(self) -> int:
        """Columns of this rank's logits that are real vocabulary ids (the rest is padding)."""
        return max(0, min(self.vocab_rows, self.full_args.vocab_size - self.vocab_start))


def tp_problem(args: ModelArgs, tp: int) -> str | None:
    """Why `args` cannot be split `tp` ways (one line naming the setting and the fix), or None."""
    fix = "Fix: choose a rollout.tp that divides them (e.g. 1 or 2)."
    if args.num_heads % tp:
        return f"rollout.tp={tp} must divide num_attention_heads={args.num_heads}. {fix}"
    if args.mla is None and args.num_kv_heads % tp and tp % args.num_kv_heads:
        return (
            f"rollout.tp={tp} must divide num_key_value_heads={args.num_kv_heads} or be a multiple of it "
            f"(KV heads are then replicated). {fix}"
        )
    widths = {"intermediate_size": args.intermediate_size}
    if args.moe is not None:
        widths["moe_intermediate_size"] = args.moe.intermediate_size
    for name, width in widths.items():
        if width % tp:
            return f"rollout.tp={tp} must divide {name}={width}. {fix}"
    return None


def _rows(weight: torch.Tensor, ranges: list[tuple[int, int]], dim: int = 0) -> torch.Tensor:
    """The (start, length) ranges of `weight` along `dim`, concatenated (a copy)."""
    return torch.cat([weight.narrow(dim, s, n) for s, n in ranges], dim=dim).contiguous()


def _linear(weight: torch.Tensor, bias: torch.Tensor | None, parts: dict[str, int] | None) -> nn.Linear:
    """A Linear (or FusedLinear with `parts`) holding these tensors."""
    out, dim = weight.shape
    with torch.device("meta"):
        layer = (
            FusedLinear(dim, parts, bias is not None) if parts else nn.Linear(dim, out, bias=bias is not None)
        )
    layer.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias, requires_grad=False)
    return layer


def _fused_parts(parent: nn.Module) -> dict[str, str]:
    """Part name -> the name of the fused projection of `parent` that holds it (`wq` -> `wqkv`)."""
    return {
        part: name
        for name, child in parent.named_children()
        if isinstance(child, FusedLinear)
        for part in child.parts
    }


class _Sharder:
    """Walks a model once, replacing modules by their shards and recording each native key's Shard."""

    def __init__(self, model: nn.Module, group: dist.ProcessGroup) -> None:
        self.model, self.group = model, group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.slices: dict[str, Shard | None] = {}

    def layer(self, layer: nn.Module, prefix: str, plan: LayerPlan) -> None:
        """Cut one decoder layer as its family's plan says, block by block (the modules it names
        inside `attention` or `feed_forward`, and the layer's own: norms, the MoE)."""
        blocks: dict[str, dict[str, Split]] = {}
        for path, split in plan.items():
            block, _, name = path.rpartition(".")
            blocks.setdefault(block, {})[name] = split
        for block, splits in blocks.items():
            module = held(layer, block) if block else layer
            if module is not None:
                self.block(module, f"{prefix}.{block}" if block else prefix, splits, reduce=True)

    def block(self, parent: nn.Module, prefix: str, splits: dict[str, Split], reduce: bool) -> None:
        """Cut the children of `parent` that `splits` names (by name; the parts of a fused projection
        by part name); the row-parallel ones all-reduce their output if `reduce`. An attention block
        is left counting its local heads."""
        columns: dict[str, dict[str, tuple[int, int]]] = {}  # holder -> {part: (start, length)}
        fused = _fused_parts(parent)
        for name, split in splits.items():
            holder = fused.get(name, name)
            child = getattr(parent, holder, None)
            if child is None:
                continue  # a module this block lacks
            if split is Split.ROW:
                self.row(parent, prefix, name, *self.split(child.weight.shape[1]), reduce=reduce)
            elif split is Split.EXPERTS:
                self.moe(child, f"{prefix}.{name}")
            elif split in (Split.COLUMN, Split.KV_COLUMN):
                width = child.parts[name] if name in fused else child.weight.shape[0]
                rows = self.kv_rows(parent, width) if split is Split.KV_COLUMN else self.split(width)
                columns.setdefault(holder, {})[name] = rows
        for holder, parts in columns.items():
            self.column(parent, prefix, holder, parts)
        if columns and hasattr(parent, "num_heads"):  # the model reshapes its projections into local heads
            parent.num_heads //= self.size
            if hasattr(parent, "num_kv_heads"):  # replicated KV heads: one per rank
                parent.num_kv_heads = max(1, parent.num_kv_heads // self.size)

    def column(self, parent: nn.Module, prefix: str, name: str, parts: dict[str, tuple[int, int]]) -> None:
        """Replace `parent.<name>` (a Linear, or FusedLinear whose parts are `parts`' keys) by the
        rows `parts[part] = (start, length)` of each part."""
        layer = getattr(parent, name)
        fused = isinstance(layer, FusedLinear)
        widths = layer.parts if fused else {name: layer.weight.shape[0]}
        assert set(parts) == set(widths), f"{prefix}.{name}: the plan splits {set(parts)} of {set(widths)}"
        ranges, offset = [], 0
        for part, width in widths.items():  # the fused layer's order, which its forward splits its output in
            start, length = parts[part]
            ranges.append((offset + start, length))
            offset += width
            key = f"{prefix}.{part}" if fused else f"{prefix}.{name}"
            self.slices[f"{key}.weight"] = Shard(0, start, length)
            if layer.bias is not None:
                self.slices[f"{key}.bias"] = Shard(0, start, length)
        bias = None if layer.bias is None else _rows(layer.bias.data, ranges)
        local_parts = {part: parts[part][1] for part in widths} if fused else None
        setattr(parent, name, _linear(_rows(layer.weight.data, ranges), bias, local_parts))

    def row(self, parent: nn.Module, prefix: str, name: str, start: int, length: int, reduce: bool) -> None:
        """Replace `parent.<name>` by its input columns [start, start + length), all-reduced if `reduce`."""
        layer = getattr(parent, name)
        weight = layer.weight.data.narrow(1, start, length).contiguous()
        bias = None if layer.bias is None else layer.bias.data
        self.slices[f"{prefix}.{name}.weight"] = Shard(1, start, length)
        setattr(
            parent,
            name,
            RowParallelLinear(weight, bias, self.group) if reduce else _linear(weight, bias, None),
        )

    def split(self, total: int) -> tuple[int, int]:
        """This rank's (start, length) of `total` split evenly (whole heads, when `total` counts heads x D)."""
        n = total // self.size
        return self.rank * n, n

    def kv_rows(self, attention: nn.Module, width: int) -> tuple[int, int]:
        """This rank's rows of a k or v projection: its KV heads, or, with fewer KV heads than ranks,
        the one KV head its query heads read."""
        kv_heads = attention.num_kv_heads
        if kv_heads >= self.size:
            return self.split(width)
        head_dim = width // kv_heads
        return self.rank * kv_heads // self.size * head_dim, head_dim

    def moe(self, moe: MoE, prefix: str) -> None:
        """Every expert's width split like the dense MLP (`MLP`), the router whole, the shared experts
        split like the MLP without an all-reduce of their own: one after routed + shared combine."""
        experts = moe.experts
        for name, split in MLP.items():
            dim = 1 if split is Split.COLUMN else 2  # stacked gate/up [E, I, D], down [E, D, I]
            full = getattr(experts, name)
            i0, width = self.split(full.shape[dim])
            setattr(
                experts,
                name,
                nn.Parameter(full.data.narrow(dim, i0, width).contiguous(), requires_grad=False),
            )
            # The adapter's per-expert slot drops the expert dim: gate/up [I, D] rows, down [D, I] columns.
            self.slices[f"{prefix}.experts.{name}"] = Shard(dim - 1, i0, width)
        if moe.shared_experts is not None:
            self.block(moe.shared_experts, f"{prefix}.shared_experts", dict(MLP), reduce=False)
        moe.__class__ = ReducedMoE
        moe.group = self.group

    def vocabulary(self, vocab_size: int) -> tuple[int, int]:
        """Vocabulary-parallel embedding and head; returns (first id, rows per rank)."""
        rows = -(-vocab_size // self.size)
        rows += -rows % 4
        start = self.rank * rows
        length = max(0, min(rows, vocab_size - start))

        def local(weight: torch.Tensor) -> torch.Tensor:
            out = weight.new_zeros(rows, weight.shape[1])
            out[:length] = weight[start : start + length]
            return out

        model = self.model
        model.tok_embeddings = VocabParallelEmbedding(
            local(model.tok_embeddings.weight.data), start, self.group
        )
        self.slices["tok_embeddings.weight"] = Shard(0, start, length)
        if model.output is not None:
            model.output = _linear(local(model.output.weight.data), None, None)
            self.slices["output.weight"] = Shard(0, start, length)
        return start, rows


@torch.no_grad()
def shard_model(model: nn.Module, group: dist.ProcessGroup) -> TPShards:
    """Cut `model` (a CausalLM, identical on every rank of `group`; real or on the meta device) down to
    this rank's shard in place; the model keeps the returned record as `tp_shards`."""
    args = model.args
    size = dist.get_world_size(group)
    problem = tp_problem(args, size)
    if problem is not None:
        raise ValueError(problem)
    sharder = _Sharder(model, group)
    plan = FAMILIES[args.model_type].tp
    for i, layer in enumerate(model.layers):
        sharder.layer(layer, f"layers.{i}", plan)
    start, rows = sharder.vocabulary(args.vocab_size)
    # This rank's heads (MLA's are its KV heads too); one KV head where tp exceeds the model's.
    heads = args.num_heads // size
    kv_heads = heads if args.mla is not None else max(1, args.num_kv_heads // size)
    model.args = dataclasses.replace(args, num_heads=heads, num_kv_heads=kv_heads)
    model.tp_shards = TPShards(group, sharder.rank, size, args, start, rows, sharder.slices)
    return model.tp_shards


def shared_seed(seed: int | None, group: dist.ProcessGroup, device: torch.device) -> int:
    """`seed`, or one drawn by the group's first rank: every rank of a replica must sample alike."""
    if seed is not None:
        return seed
    value = torch.tensor([random.randrange(2**62)], dtype=torch.int64, device=device)
    dist.broadcast(value, src=dist.get_global_rank(group, 0), group=group)
    return int(value.item())
