"""Context parallelism (CP) for packed variable-length sequences: one micro-batch split over cp ranks.

torch's `context_parallel` shards SDPA inputs only and torchtitan refuses varlen CP, so this is
rlloom's own, after the "all-gather K/V" variant of ring attention (Llama 3 paper, section 3.3.2;
ring-flash-attn's llama3 functions) with Megatron-LM's load balancing by chunk pairs:

1. `balance_chunks` (pure): every document of the packed stream is cut into 2 x cp chunks and each
   rank takes a pair of them, one from the front and its mirror from the back. A token at document
   position p attends to p + 1 keys, so a front chunk is cheap and its mirror expensive; the pair
   costs the same on every rank (bound in the docstring). Which pair a rank takes rotates with the
   document, so that rounding leftovers do not all land on one rank.
2. `CPShard` (one rank's share, built on the host from cu_seqlens): `take(x_N)` picks the rank's
   tokens (input ids, position ids, MoE routes) in local order. Position ids come from the full
   stream, so RoPE sees each token's global position in its document.
3. Attention: the model runs on the local tokens with `attn=shard` (the model's attention backend
   hook, see `rlloom.models.attention_ops`). Each layer all-gathers K/V over the cp group (one
   collective for both; its backward is a reduce-scatter of their gradients) and the rank's queries
   attend to the gathered keys, block-causal within each document by global key position:
   - CPU and other cases (the reference): one SDPA with an explicit [n, cp x n] bool mask.
   - CUDA with bf16/fp16: one FlashAttention varlen call (`torch.nn.attention.varlen.varlen_attn`)
     over runs: each local chunk is a run whose keys are its document's tokens up to the chunk's
     end, gathered by an index (bottom-right causal alignment makes that exactly the block-causal
     mask). MLA's narrower V is zero-padded to the q/k width. The runs are tested on CPU against a
     stand-in of the kernel; the kernel itself needs a GPU run.
4. `gather_selected`: the logprobs of the whole micro-batch on every cp rank, differentiable.
5. Under pipeline parallelism the shares must have one fixed size: `fixed_shares` cuts the padded
   micro-batch into cp shares of exactly budget / cp tokens (`pp_batches.pad_to_budget`).

Padding: the ranks' token counts differ by a few (at most 2 per document). The model runs on each
rank's own tokens only; the K/V all-gather pads the shorter blocks with zero rows (collectives need
equal sizes) that no query sees, so MoE loads and routes count real tokens only. With pad_multiple
> 1 (sequence parallelism needs a multiple of tp) the local stream ends in pad tokens, a
pseudo-document of their own: they attend to themselves only and their outputs are dropped.

The training engine (engines/train/native/policy.py, `run_micro_batch` with a cp group) does, per
micro-batch, on every cp rank of a dp rank (they run the same micro-batches):

    shard = CPShard(packed.cu_seqlens, group=cp_group, device=device, pad_multiple=tp)
    mine_K, local_K = shard.localize(positions_K)              # the selected positions held here
    hidden = model.hidden_states(shard.take(input_ids_N), position_ids=shard.take(position_ids_N),
                                 attn=shard, routes_NLK=shard.take(routes_NLK))
    logp_k = token_logprobs(hidden[local_K[mine_K]], head, targets_K[mine_K])
    logp_K = shard.gather_selected(logp_k, mine_K)             # the same on every cp rank

Every cp rank then runs the unchanged loss function on the whole micro-batch (sequence-level
losses such as GSPO need all of a sequence's tokens), divided by the global batch's normaliser;
`gather_selected`'s backward keeps the rank's own entries, so its backward covers its own tokens,
and FSDP's gradient sum over dp_shard x cp (`apply_fsdp` divides by 1) adds the cp ranks' parts.
Metrics computed from the logprobs are whole on every cp rank and are reduced over dp as before;
what each rank computed on its own tokens is summed over dp x cp (`ParallelDims.loss_mesh()`): the
MoE loads (bias update, load metrics) and the route-mismatch counts. The MoE auxiliary loss
(train.moe_aux_loss_coef > 0, off in RL) does not add over token subsets: each cp rank sums the
expert counts over the cp ranks first, so its term is its part of the whole micro-batch's loss
and the parts (gradients and moe/aux_loss, summed over dp x cp) are exact, at pp=1 as under PP
(`pp_aux.py`). The shared-prompt layout is refused (`check_cp_layout`, and the config at start-up).

Shape legend: N tokens of the full stream, S documents, n tokens per rank (the longest local
stream), H heads, D head channels, K selected positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rlloom.devices import to_device
from rlloom.models.attention_ops import VarlenRuns, flash_varlen_fits, varlen_causal, varlen_runs
from rlloom.parallel.distributed import all_gather_rows, all_gather_tensor


@dataclass(frozen=True, slots=True)
class Chunk:
    """A contiguous piece of one document: positions [start, end) of document `doc`."""

    doc: int
    start: int
    end: int


def chunk_bounds(length: int, cp: int) -> list[int]:
    """The 2 x cp + 1 boundaries cutting a document of `length` tokens into near-equal chunks."""
    return [(i * length) // (2 * cp) for i in range(2 * cp + 1)]


def balance_chunks(seq_lens: Sequence[int], cp: int) -> list[list[Chunk]]:
    """Per cp rank, its non-empty chunks in local order (documents in stream order, front chunk first).

    Document s is cut at `chunk_bounds(L_s, cp)`; rank r takes chunk pair p = (r + s) mod cp: chunks
    p and 2cp-1-p (one chunk when they touch, as the middle pair does). Every token goes to exactly
    one rank. Bounds, with cost = sum over a rank's tokens of (document position + 1), the
    query-key pairs of causal attention: per document, the ranks' token counts differ by at most 2
    and their costs by less than 2 (L_s + 1), against an ideal share of about L_s^2 / (2 cp) (a
    relative imbalance under 4 cp / L_s).
    """
    if cp < 1:
        raise ValueError(f"parallel.cp={cp} is invalid: must be >= 1. Fix: use 1 to turn it off.")
    shares: list[list[Chunk]] = [[] for _ in range(cp)]
    for s, length in enumerate(seq_lens):
        bounds = chunk_bounds(length, cp)
        for r in range(cp):
            p = (r + s) % cp
            for i in (p, 2 * cp - 1 - p):
                if bounds[i + 1] == bounds[i]:
                    continue
                share = shares[r]
                if share and share[-1].doc == s and share[-1].end == bounds[i]:  # the middle pair
                    share[-1] = Chunk(s, share[-1].start, bounds[i + 1])
                else:
                    share.append(Chunk(s, bounds[i], bounds[i + 1]))
    return shares


def fixed_shares(seq_lens: Sequence[int], cp: int, *, padded: bool) -> list[list[Chunk]]:
    """Per cp rank, chunks of exactly sum(seq_lens) / cp tokens (pipeline parallelism: the shapes a
    stage sends never change). `padded`: the last document is the padding `pp_batches.pad_to_budget`
    appends. The real documents are balanced as `balance_chunks` does and the padding fills each
    rank up to its share, in rank order; should a balanced share not fit (many short documents in a
    full budget), the stream is cut into cp contiguous pieces instead (exact, not cost-balanced)."""
    total = sum(seq_lens)
    if total % cp:
        raise ValueError(
            f"a pipeline micro-batch of {total} tokens does not split into parallel.cp={cp} equal shares. "
            f"Fix: set train.max_tokens_per_micro_batch to a multiple of {cp}."
        )
    per_rank = total // cp
    docs = list(seq_lens[:-1]) if padded else list(seq_lens)
    shares = balance_chunks(docs, cp)
    counts = [sum(c.end - c.start for c in share) for share in shares]
    if max(counts) <= per_rank:
        start = 0
        for share, count in zip(shares, counts):
            if count < per_rank:  # only when padded: the real tokens alone fill every share otherwise
                share.append(Chunk(len(docs), start, start + per_rank - count))
                start += per_rank - count
        return shares
    bounds = [0]
    for length in seq_lens:
        bounds.append(bounds[-1] + length)
    shares = [[] for _ in range(cp)]
    for r, share in enumerate(shares):
        lo, hi = r * per_rank, (r + 1) * per_rank
        for s, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
            if max(a, lo) < min(b, hi):
                share.append(Chunk(s, max(a, lo) - a, min(b, hi) - a))
    return shares


def check_cp_layout(cp: int, share_prompts: bool | None) -> None:
    """ValueError when the settings ask for a layout CP does not run: the shared-prompt packing
    (asked for by name: null lets the engine turn it off)."""
    if cp > 1 and share_prompts is True:
        raise ValueError(
            f"train.share_prompts=true does not work with parallel.cp={cp}: context parallelism splits "
            "plain packed documents, not shared-prompt trees. Fix: set train.share_prompts=false (or "
            "parallel.cp=1)."
        )


class CPShard:
    """One cp rank's share of a packed stream, and the attention backend that runs on it.

    cu_seqlens [S + 1]: the full stream's documents (read on the host). group: the cp process group
    (default: the world). pad_multiple: the local stream is padded to a multiple of it (pass the TP
    degree: sequence parallelism splits it over the TP ranks). device: where the model's index
    tensors go. shares: each rank's chunks (default `balance_chunks`; pipelines pass `fixed_shares`).
    """

    def __init__(
        self,
        cu_seqlens: torch.Tensor | Sequence[int],
        *,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str = "cpu",
        pad_multiple: int = 1,
        shares: list[list[Chunk]] | None = None,
    ) -> None:
        self.group = group
        self.cp = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.device = torch.device(device)
        cu = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
        self.cu = cu
        self.num_tokens = cu[-1]
        lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
        self.shares = shares if shares is not None else balance_chunks(lens, self.cp)
        counts = [sum(c.end - c.start for c in share) for share in self.shares]
        self.num_real = counts[self.rank]
        """Stream tokens this rank holds."""
        self.local_len = _round_up(self.num_real, pad_multiple)
        """Tokens the model runs on here: num_real, then pads up to a multiple of pad_multiple."""
        self.n = max(max(_round_up(c, pad_multiple) for c in counts), 1)
        """Slots per rank in the gathered K/V (the longest local stream; shorter ones pad with zeros)."""
        # Per slot of the gathered buffer: its stream position (pads: -1), its document (pads: a
        # pseudo-document S + rank) and its position in the document.
        streams, docs, pos = [], [], []
        for r, share in enumerate(self.shares):
            pad = self.n - counts[r]
            streams += [torch.arange(cu[c.doc] + c.start, cu[c.doc] + c.end) for c in share]
            streams.append(torch.full((pad,), -1))
            docs += [torch.full((c.end - c.start,), c.doc) for c in share] + [
                torch.full((pad,), len(lens) + r)
            ]
            pos += [torch.arange(c.start, c.end) for c in share] + [torch.arange(pad)]
        self.stream_slot = torch.cat(streams)
        """[cp x n] stream position of each slot of the gathered buffer (-1: padding)."""
        self.slot_doc, self.slot_pos = torch.cat(docs), torch.cat(pos)
        self.slot_of = torch.empty(self.num_tokens, dtype=torch.int64)
        """[N] the gathered-buffer slot of each stream position."""
        real = self.stream_slot >= 0
        self.slot_of[self.stream_slot[real]] = torch.arange(self.cp * self.n)[real]
        mine = self.stream_slot[self.rank * self.n : self.rank * self.n + self.local_len]
        self.index = to_device(mine.clamp(min=0), self.device)
        """[local_len] stream position of each local token (pads repeat position 0: junk outputs)."""
        self._mask: torch.Tensor | None = None
        self._varlen: VarlenRuns | None = None
        if self.device.type == "cuda":
            self.varlen()  # built before the layers, as TreePlan does

    def take(self, x_N: torch.Tensor) -> torch.Tensor:
        """This rank's rows [local_len, ...] of a full-stream tensor [N, ...] (input ids, position ids,
        routes)."""
        return x_N[to_device(self.index, x_N.device)]

    def localize(self, positions_K: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mine_K bool, local_K int64) for stream positions [K]: whether this rank holds each and
        where in its local tokens (meaningful where mine_K)."""
        slots = self.slot_of.to(positions_K.device)[positions_K]
        mine = (slots // self.n) == self.rank
        return mine, slots - self.rank * self.n

    @torch.no_grad()
    def unshard(self, y_n: torch.Tensor) -> torch.Tensor:
        """The full stream [N, ...] of every rank's local rows [local_len, ...] (forward only, e.g. tests)."""
        gathered = y_n.new_empty((self.cp * self.n, *y_n.shape[1:]))
        all_gather_tensor(gathered, self._pad_rows(y_n), group=self.group)
        return gathered[to_device(self.slot_of, y_n.device)]

    def mask(self) -> torch.Tensor:
        """[local_len, cp x n] bool: local query i sees slot j iff same document and j's position <= i's."""
        if self._mask is None:
            lo, hi = self.rank * self.n, self.rank * self.n + self.local_len
            q_doc, q_pos = self.slot_doc[lo:hi, None], self.slot_pos[lo:hi, None]
            visible = (q_doc == self.slot_doc[None]) & (self.slot_pos[None] <= q_pos)
            self._mask = to_device(visible, self.device)
        return self._mask

    def varlen(self) -> VarlenRuns:
        """(cu_q, cu_k [U + 1] int32, kv_index [M] int64, max_q, max_k) over U runs: each local chunk
        (then the padding) is a run of queries whose keys are kv_index[cu_k[u]:cu_k[u + 1]], the slots
        of its document's positions 0 .. chunk end (the padding: itself)."""
        if self._varlen is None:
            q_lens, k_lens, kv_index = [], [], []
            for c in self.shares[self.rank]:
                q_lens.append(c.end - c.start)
                k_lens.append(c.end)
                kv_index.append(self.slot_of[self.cu[c.doc] : self.cu[c.doc] + c.end])
            pad = self.local_len - self.num_real
            if pad:
                q_lens.append(pad)
                k_lens.append(pad)
                start = self.rank * self.n + self.num_real
                kv_index.append(torch.arange(start, start + pad))
            self._varlen = varlen_runs(q_lens, k_lens, kv_index, self.device)
        return self._varlen

    def attn(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """The attention backend hook: local q [n, Hq, Dqk], k [n, Hkv, Dqk], v [n, Hkv, Dv] ->
        [n, Hq, Dv] (n = local_len), the queries attending to every rank's keys (module docstring)."""
        dk = k.shape[-1]
        kv_all = all_gather_tokens(self._pad_rows(torch.cat([k, v], dim=-1)), self.group)
        k_all, v_all = kv_all[..., :dk], kv_all[..., dk:]
        if self.use_varlen(q):
            return self._varlen_attention(q, k_all, v_all, scale)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k_all.transpose(0, 1),
            v_all.transpose(0, 1),
            attn_mask=self.mask(),
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        return out.transpose(0, 1)

    def _pad_rows(self, x: torch.Tensor) -> torch.Tensor:
        """x [local_len, ...] with zero rows up to [n, ...], the collectives' common size."""
        pad = self.n - x.shape[0]
        return torch.cat([x, x.new_zeros(pad, *x.shape[1:])]) if pad else x.contiguous()

    def use_varlen(self, q: torch.Tensor) -> bool:
        """Whether the FlashAttention varlen kernel runs (CUDA, bf16/fp16, a head width it takes; v
        is padded to q's) instead of the reference."""
        return flash_varlen_fits(q, q)

    def gather_selected(self, values_k: torch.Tensor, mine_K: torch.Tensor) -> torch.Tensor:
        """Values [K] at every selected position from this rank's values [k] at the positions it holds
        (`mine_K` from `localize`; each position is held by exactly one rank). Differentiable on the
        condition that every cp rank computes the same loss from the result: the backward passes
        each rank the gradient of its own entries, without communication."""
        return _GatherSelected.apply(values_k, mine_K.to(values_k.device), self.group)

    def _varlen_attention(
        self, q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, scale: float
    ) -> torch.Tensor:
        cu_q, cu_k, kv_index, max_q, max_k = self.varlen()
        dv = v_all.shape[-1]
        k_run, v_run = k_all[kv_index], v_all[kv_index]
        if dv < q.shape[-1]:  # MLA: the kernel wants one head width; zero channels add nothing
            v_run = F.pad(v_run, (0, q.shape[-1] - dv))
        out = varlen_causal(q, k_run, v_run, scale, cu_q, cu_k, max_q, max_k)
        return out[..., :dv]


class _GatherSelected(torch.autograd.Function):
    """Forward: every rank's disjoint entries summed into one [K]; backward: a rank's own entries."""

    @staticmethod
    def forward(
        ctx,  # noqa: ANN001
        values_k: torch.Tensor,
        mine_K: torch.Tensor,
        group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        ctx.save_for_backward(mine_K)
        out = values_k.new_zeros(mine_K.shape[0], *values_k.shape[1:])
        out[mine_K] = values_k
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_K: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # noqa: ANN001
        (mine_K,) = ctx.saved_tensors
        return grad_K[mine_K], None, None


def all_gather_tokens(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Every rank's x [n, ...] stacked in rank order [cp x n, ...]; differentiable (each rank gets
    the sum over ranks of the gradients of its rows: the backward reduce-scatters). Recomputed in
    the backward of a checkpointed layer, compiled or not (`all_gather_rows`)."""
    return all_gather_rows(x, group if group is not None else dist.group.WORLD)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple
