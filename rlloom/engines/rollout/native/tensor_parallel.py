"""Tensor parallelism of one rollout engine: `shard_model` cuts a loaded (fused) CausalLM down to the
part one rank of a `rollout.tp` group runs, in place; `TPShards` records what each rank holds.

The Megatron scheme (nano-vllm `layers/linear.py` and `layers/embed_head.py` follow it too):
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
from rlloom.models.attention import Attention
from rlloom.models.layers import FusedLinear, SwiGLU
from rlloom.models.mla import MLAttention
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


class _Sharder:
    """Walks a model once, replacing modules by their shards and recording each native key's Shard."""

    def __init__(self, model: nn.Module, group: dist.ProcessGroup) -> None:
        self.model, self.group = model, group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.slices: dict[str, Shard | None] = {}

    def column(self, parent: nn.Module, prefix: str, name: str, parts: dict[str, tuple[int, int]]) -> None:
        """Replace `parent.<name>` (a Linear, or FusedLinear whose parts are `parts`' keys) by the
        rows `parts[part] = (start, length)` of each part."""
        layer = getattr(parent, name)
        fused = isinstance(layer, FusedLinear)
        offsets, ranges, offset = {}, [], 0
        for part, width in (layer.parts if fused else {name: layer.weight.shape[0]}).items():
            offsets[part] = offset
            offset += width
        for part, (start, length) in parts.items():
            ranges.append((offsets[part] + start, length))
            key = f"{prefix}.{part}" if fused else f"{prefix}.{name}"
            self.slices[f"{key}.weight"] = Shard(0, start, length)
            if layer.bias is not None:
                self.slices[f"{key}.bias"] = Shard(0, start, length)
        bias = None if layer.bias is None else _rows(layer.bias.data, ranges)
        local_parts = {part: n for part, (_, n) in parts.items()} if fused else None
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
        n = total // self.size
        return self.rank * n, n

    def attention(self, att: Attention, prefix: str) -> None:
        hd, hq, hkv = att.head_dim, att.num_heads, att.num_kv_heads
        q0, q_heads = self.split(hq)
        if hkv >= self.size:
            kv0, kv_heads = self.split(hkv)
        else:  # replicated KV: the one head this rank's query heads read
            kv0, kv_heads = self.rank * hkv // self.size, 1
        parts = {
            "wq": (q0 * hd, q_heads * hd),
            "wk": (kv0 * hd, kv_heads * hd),
            "wv": (kv0 * hd, kv_heads * hd),
        }
        if att.fused:
            self.column(att, f"{prefix}.attention", "wqkv", parts)
        else:
            for name, rows in parts.items():
                self.column(att, f"{prefix}.attention", name, {name: rows})
        self.row(att, f"{prefix}.attention", "wo", q0 * hd, q_heads * hd, reduce=True)
        att.num_heads, att.num_kv_heads = q_heads, kv_heads

    def mla(self, att: MLAttention, prefix: str) -> None:
        h0, heads = self.split(att.num_heads)
        qk, kv = att.nope_dim + att.rope_dim, att.nope_dim + att.v_dim
        q_name = "wq_b" if att.has_q_lora else "wq"
        self.column(att, f"{prefix}.attention", q_name, {q_name: (h0 * qk, heads * qk)})
        self.column(att, f"{prefix}.attention", "wkv_b", {"wkv_b": (h0 * kv, heads * kv)})
        self.row(att, f"{prefix}.attention", "wo", h0 * att.v_dim, heads * att.v_dim, reduce=True)
        att.num_heads = heads

    def mlp(self, mlp: SwiGLU, prefix: str, reduce: bool) -> None:
        i0, width = self.split(mlp.w2.weight.shape[1])
        if mlp.fused:
            self.column(mlp, prefix, "w13", {"w1": (i0, width), "w3": (i0, width)})
        else:
            self.column(mlp, prefix, "w1", {"w1": (i0, width)})
            self.column(mlp, prefix, "w3", {"w3": (i0, width)})
        self.row(mlp, prefix, "w2", i0, width, reduce=reduce)

    def moe(self, moe: MoE, prefix: str) -> None:
        experts = moe.experts
        i0, width = self.split(experts.w1.shape[1])
        for name, dim in (("w1", 1), ("w3", 1), ("w2", 2)):
            full = getattr(experts, name)
            setattr(
                experts,
                name,
                nn.Parameter(full.data.narrow(dim, i0, width).contiguous(), requires_grad=False),
            )
            # The adapter's per-expert slot drops the expert dim: gate/up [I, D] rows, down [D, I] columns.
            self.slices[f"{prefix}.moe.experts.{name}"] = Shard(dim - 1, i0, width)
        if moe.shared_experts is not None:
            self.mlp(moe.shared_experts, f"{prefix}.moe.shared_experts", reduce=False)
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
    for i, layer in enumerate(model.layers):
        prefix = f"layers.{i}"
        if isinstance(layer.attention, MLAttention):
            sharder.mla(layer.attention, prefix)
        else:
            sharder.attention(layer.attention, prefix)
        if layer.moe is not None:
            sharder.moe(layer.moe, prefix)
        else:
            sharder.mlp(layer.feed_forward, f"{prefix}.feed_forward", reduce=True)
    start, rows = sharder.vocabulary(args.vocab_size)
    attention = model.layers[0].attention
    model.args = dataclasses.replace(
        args,
        num_heads=attention.num_heads,
        num_kv_heads=getattr(attention, "num_kv_heads", attention.num_heads),
    )
    model.tp_shards = TPShards(group, sharder.rank, size, args, start, rows, sharder.slices)
    return model.tp_shards


def shared_seed(seed: int | None, group: dist.ProcessGroup, device: torch.device) -> int:
    """`seed`, or one drawn by the group's first rank: every rank of a replica must sample alike."""
    if seed is not None:
        return seed
    value = torch.tensor([random.randrange(2**62)], dtype=torch.int64, device=device)
    dist.broadcast(value, src=dist.get_global_rank(group, 0), group=group)
    return int(value.item())
