"""ModelRunner: owns the KV cache, turns scheduled sequences into model inputs, returns logits.

- prefill: the uncached tokens of every sequence packed into one flat stream [N] with their
  positions and cache slots; attention sees each sequence's cached prefix plus its new tokens.
- decode: one token per sequence. On CUDA (unless enforce_eager) the forward replays a captured
  CUDA graph (cuda_graphs.py) and attention uses the Triton paged-decode kernel when it passes its
  known-answer check (paged_decode.py); elsewhere it runs eagerly through the torch path. With
  `compile` (CUDA graphs only) the captured forward runs `torch.compile`d decoder layers with a
  dynamic batch size: Inductor fuses the small per-layer kernels (RMSNorms, RoPE, SwiGLU, residual
  adds; about 45 launches a layer eagerly) that otherwise cost a third of a decode step. Every
  model compiles one layer at a time, split at the attention call, so Dynamo traces one layer, not
  the whole model (`compile_decode_forward`). If the compiled forward fails to compile or capture,
  the runner logs it and captures the plain one.

Only the last position of each sequence goes through the lm head, so prefill never builds [N, V]
logits. Logits are computed as the model's own forward does (hidden @ lm_head_weight.T in the model
dtype) and returned in that dtype; the sampler works in fp32.

The cache is `num_blocks + 1` blocks: the extra one is scratch space for padded graph rows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch
import torch.fx.experimental._config as fx_config

from rlloom.compile_cache import enable_compile_cache
from rlloom.devices import to_device
from rlloom.engines.rollout.native.attention import (
    AttnContext,
    PagedAttention,
    PiecewiseAttention,
    new_handle,
)
from rlloom.engines.rollout.native.cuda_graphs import (
    MEMBERS,
    POSITION,
    PREFIX_KEYS,
    PREFIX_START,
    SLOT,
    TOKEN,
    DecodeGraphs,
    GraphCaptureError,
    table_column,
)
from rlloom.engines.rollout.native.paged_decode import (
    SharedPrefix,
    decode_kernel_works,
    max_group_members,
    shared_prefix_groups,
)
from rlloom.engines.rollout.native.sequence import Sequence, take_pending
from rlloom.engines.rollout.native.vision import prefill_rows
from rlloom.models.args import ModelArgs
from rlloom.models.model import CausalLM

logger = logging.getLogger(__name__)


def kv_bytes_per_block(a: ModelArgs, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of keys and values one block holds across all layers of a model with args `a`."""
    return a.num_layers * block_size * a.kv_cache.values_per_token * dtype.itemsize


def compile_decode_forward(model: CausalLM) -> Callable[..., torch.Tensor]:
    """`model.hidden_states` compiled for the CUDA graphs to capture, with a dynamic token count:
    every decoder layer compiled on its own, split at the attention call (attention.py), so the
    layers share one traced layer (two for DeepSeek-V3's dense and MoE layers). Against the whole
    model in one graph (the earlier way, measured on one H200, docs/benchmarks.md): Qwen3-0.6B's
    second run reaches its first token in 17 s instead of 38 s and decodes as fast; the
    Qwen3-30B-A3B width compiles in 5.8 s instead of 16.3 s and decodes at 23.6k instead of 15.4k
    tok/s after a full-batch warm-up (the whole-model graph stalled mid-run). The compiled
    code is cached on disk (`rlloom.compile_cache`) for later runs of the same shapes.

    Dynamo compiles without duck sizing (one symbol for every input size of equal value): with it, a
    first call whose token count equals a width of the model (a prefill of 16 prompts x 64 tokens =
    Qwen3-0.6B's hidden size 1024) compiled a graph static in the token count, and a later count
    added a dynamic graph that from then on served that count too. The two round differently
    (Inductor picks a reduction's tiling by the sizes it compiles for), so which one ran a forward
    depended on the calls the process made before: a fresh engine (a replaced rollout actor, a resumed
    run) gave a step other bits than the engine that had run the steps before it. Without duck sizing
    every count of at least 2 tokens runs the one dynamic graph (a count of 1 has its own), whatever
    came before; `ModelRunner` compiles it at one fixed size."""
    enable_compile_cache()
    layers = [torch.compile(layer, dynamic=True) for layer in model.layers]

    def forward(input_ids: torch.Tensor, *, position_ids: torch.Tensor, attn: PagedAttention) -> torch.Tensor:
        piecewise = PiecewiseAttention(attn)
        with fx_config.patch(use_duck_shape=False):  # read when a call compiles
            return model.hidden_states(input_ids, position_ids=position_ids, attn=piecewise, layers=layers)

    return forward


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        *,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        enforce_eager: bool,
        compile: bool = True,
    ) -> None:
        self.model = model
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.max_members = max_group_members(model.args.num_heads, model.args.kv_cache.num_heads)
        self.use_graphs = self.device.type == "cuda" and not enforce_eager
        self.compiled_forward = compile_decode_forward(model) if self.use_graphs and compile else None
        """The decode forward the graphs capture when compiled (None: the plain one; one compilation
        per runner: the backend handle stays the same across sleep/wake, so guards keep matching)."""
        self._handle = new_handle()
        moe = model.args.moe
        self.route_dtype = None if moe is None else (torch.uint8 if moe.num_experts <= 256 else torch.int16)
        """MoE models: the dtype the experts chosen per token are recorded in (None: dense model)."""
        self.last_routes: torch.Tensor | None = None
        """[rows of the last forward, MoE layers, K] experts per token of the last `run` (MoE only):
        every new token of a prefill in input order, one row per sequence of a decode."""
        self.backend: PagedAttention | None = None
        self.graphs: DecodeGraphs | None = None
        self.allocate()
        if self.compiled_forward is not None:
            self._compile_now()

    def _compile_now(self) -> None:
        """Compile the decode forward at the largest decode batch, before any request: Inductor tunes
        its kernels for the sizes of the call that compiles them, so every engine (a fresh one in a
        replaced actor or a resumed run too) runs the same kernels, whatever its first request (and
        the disk cache holds the same entry). A forward that fails to compile falls back to the plain one."""
        assert self.graphs is not None
        try:
            self.graphs.warm_up(self.graphs.batch_sizes[-1], self.graphs.block_buckets[0])
        except GraphCaptureError as err:
            logger.warning("%s; using the uncompiled forward from now on", err)
            self.compiled_forward = None
            self.graphs = self._new_graphs()

    def allocate(self) -> None:
        """Allocate the KV cache (zeros, so masked-out slots never hold NaN); graphs are captured on use."""
        a = self.model.args
        self.device = next(self.model.parameters()).device
        slots = (self.num_blocks + 1) * self.block_size
        kv = a.kv_cache
        k_cache = torch.zeros(
            a.num_layers, slots, kv.num_heads, kv.key_dim, dtype=self.dtype, device=self.device
        )
        if kv.value_in_key:  # MLA: the values are the latent, the keys' first channels (no copy)
            v_cache = k_cache[..., : kv.value_dim]
        else:
            v_cache = torch.zeros(
                a.num_layers, slots, kv.num_heads, kv.value_dim, dtype=self.dtype, device=self.device
            )
        use_kernel = self.device.type == "cuda" and decode_kernel_works(
            self.device, self.dtype, a.num_heads, kv.num_heads, kv.key_dim, kv.value_dim
        )
        self.backend = PagedAttention(
            k_cache, v_cache, self.block_size, use_decode_kernel=use_kernel, handle=self._handle
        )
        if self.use_graphs:
            self.graphs = self._new_graphs()

    def _new_graphs(self) -> DecodeGraphs:
        return DecodeGraphs(
            self.model,
            self.backend,
            max_num_seqs=self.max_num_seqs,
            max_blocks_per_seq=self.max_blocks_per_seq,
            scratch_block=self.num_blocks,
            forward=self.compiled_forward,
            route_dtype=self.route_dtype,
        )

    def free(self) -> None:
        """Drop the KV cache and the graphs (they point into it)."""
        self.backend = None
        self.graphs = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _tensor(self, values: list[int] | list[list[int]]) -> torch.Tensor:
        return to_device(torch.tensor(values, dtype=torch.int64), self.device)

    @torch.no_grad()
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks (copy-on-write of shared blocks); all sources are read before any write."""
        if not pairs:
            return
        assert self.backend is not None
        src, dst = self._tensor([s for s, _ in pairs]), self._tensor([d for _, d in pairs])
        for cache in self.backend.caches():
            blocks = cache.view(cache.shape[0], -1, self.block_size, *cache.shape[2:])
            blocks[:, dst] = blocks[:, src]

    @torch.no_grad()
    def run(
        self, seqs: list[Sequence], is_prefill: bool, pending_R: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits [S, V] in the model dtype of the last position of each sequence (the sampler
        upcasts; its fused CUDA kernel reads them once instead of an fp32 copy). A decode sequence
        whose last token is pending (`sequence.pending(r)`) reads it from `pending_R[r]`, the
        sampled tokens of the step in flight."""
        assert self.backend is not None, "the KV cache is freed (engine asleep)"
        self.last_routes = None
        hidden_SD = self._prefill(seqs) if is_prefill else self._decode(seqs, pending_R)
        return hidden_SD @ self.model.lm_head_weight.T

    def _record_routes(self) -> None:
        if self.route_dtype is not None:
            self.last_routes = self.model.last_routes().to(self.route_dtype)

    def _slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    def _padded_tables(self, seqs: list[Sequence], num_blocks: int) -> torch.Tensor:
        return self._tensor([s.block_table + [0] * (num_blocks - len(s.block_table)) for s in seqs])

    def _prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        num_new = [s.num_tokens - s.num_cached_tokens for s in seqs]
        Q = max(num_new)
        width = max(len(s.block_table) for s in seqs)
        ids, positions, slots, query_index, query_pos, output_index, last = [], [], [], [], [], [], []
        offset = 0
        for row, (seq, n) in enumerate(zip(seqs, num_new)):
            start, end = seq.num_cached_tokens, seq.num_tokens
            ids += seq.token_ids[start:end]
            positions += range(start, end)
            slots += [self._slot(seq, p) for p in range(start, end)]
            query_index.append(list(range(offset, offset + n)) + [0] * (Q - n))
            query_pos.append(list(range(start, end)) + [0] * (Q - n))
            output_index += range(row * Q, row * Q + n)
            offset += n
            last.append(offset - 1)
        assert min(ids) >= 0, "a prefill got a pending token: resolve the step in flight first"
        self.backend.prepare(
            AttnContext(
                slot_mapping_N=self._tensor(slots),
                block_tables_SB=self._padded_tables(seqs, width),
                query_index_SQ=self._tensor(query_index),
                query_pos_SQ=self._tensor(query_pos),
                output_index_N=self._tensor(output_index),
            )
        )
        # The compiled layers take any token count: a prefill through them launches a few fused
        # kernels a layer instead of dozens (an eager prefill step was host-bound on an H200).
        forward = self.compiled_forward or self.model.hidden_states
        if self.model.args.vision is not None:
            hidden_ND = self._prefill_vision(seqs, ids)
        else:
            hidden_ND = forward(self._tensor(ids), position_ids=self._tensor(positions), attn=self.backend)
        self._record_routes()
        return hidden_ND[self._tensor(last)]

    def _prefill_vision(self, seqs: list[Sequence], ids: list[int]) -> torch.Tensor:
        """The prefill forward of a vision-language model: M-RoPE positions [3, N] and the prompts'
        image features in place of their image tokens (vision.py)."""
        positions, embeds, index, offset = [], [], [], 0
        for seq in seqs:
            start, end = seq.num_cached_tokens, seq.num_tokens
            pos, rows, offsets = prefill_rows(seq.prompt_ids, seq.vision, start, end)
            positions.append(pos)
            if rows is not None and offsets:
                embeds.append(rows)
                index += [offset + i for i in offsets]
            offset += end - start
        return self.model.hidden_states(
            self._tensor(ids),
            position_ids=to_device(torch.cat(positions, dim=1), self.device),
            attn=self.backend,
            image_embeds=torch.cat(embeds) if embeds else None,
            image_index=self._tensor(index) if embeds else None,
        )

    def _decode_rows(self, seqs: list[Sequence]) -> np.ndarray:
        """[S, table_column(M) + B] int64 in the column layout above (B = the longest table, padded
        with the scratch block). One numpy buffer, so a 512-sequence step costs one host-to-device
        copy and no nested Python lists. Groups are found only for the Triton kernel (the torch path
        reads every sequence's keys itself): none has 0 keys and no members (-1)."""
        tables = [s.block_table for s in seqs]
        width = max(map(len, tables))
        first_table = table_column(self.max_members)
        rows = np.full((len(seqs), first_table + width), self.num_blocks, dtype=np.int64)
        bs = self.block_size
        heads = []
        for seq, table in zip(seqs, tables):
            out = seq.output_ids
            pos = len(seq.prompt_ids) + len(out) - 1
            heads.append((out[-1] if out else seq.prompt_ids[-1], pos, table[pos // bs] * bs + pos % bs))
        rows[:, :PREFIX_START] = heads
        if all(len(t) == width for t in tables):
            rows[:, first_table:] = tables
        else:
            for i, table in enumerate(tables):
                rows[i, first_table : first_table + len(table)] = table
        if self.backend.use_decode_kernel and len(seqs) > 1:
            members, num_keys, start = shared_prefix_groups(
                rows[:, first_table:], rows[:, POSITION], bs, self.max_members
            )
            rows[:, PREFIX_START], rows[:, PREFIX_KEYS], rows[:, MEMBERS:first_table] = (
                start,
                num_keys,
                members,
            )
        else:
            rows[:, PREFIX_START : PREFIX_KEYS + 1], rows[:, MEMBERS:first_table] = 0, -1
        return rows

    def _rope_deltas(self, seqs: list[Sequence]) -> torch.Tensor | None:
        """M-RoPE: a decode token of a vision-language prompt sits at its index + delta [S] on the
        device (None: a text model, whose rotary positions are the cache positions)."""
        if self.model.args.vision is None:
            return None
        return self._tensor([0 if s.vision is None else s.vision.delta for s in seqs])

    def _decode(self, seqs: list[Sequence], pending_R: torch.Tensor | None) -> torch.Tensor:
        rows = self._decode_rows(seqs)
        first_table = table_column(self.max_members)
        if not (rows[:, TOKEN] < 0).any():
            pending_R = None  # every input token is known on the host
        else:
            assert pending_R is not None, "a decode input is pending but no step is in flight"
        rope_delta_S = self._rope_deltas(seqs)
        if self.graphs is not None and self.graphs.fits(len(seqs), rows.shape[1] - first_table):
            try:
                hidden_SD, routes = self.graphs.run(rows, pending_R, rope_delta_S)
                if self.route_dtype is not None:
                    self.last_routes = routes
                return hidden_SD
            except GraphCaptureError as err:
                if self.compiled_forward is not None:  # capture the plain forward instead
                    logger.warning("%s; capturing the uncompiled decode forward from now on", err)
                    self.compiled_forward = None
                    self.graphs = self._new_graphs()
                    return self._decode(seqs, pending_R)
                # e.g. a layer that syncs with the host: decode eagerly
                logger.warning("%s; decoding eagerly from now on", err)
                self.graphs = None
        staged = to_device(torch.from_numpy(rows), self.device)
        rows_S = torch.arange(len(seqs), device=self.device)
        positions_S = staged[:, POSITION]
        prefix = None
        if (rows[:, PREFIX_KEYS] > 0).any():
            prefix = SharedPrefix(
                staged[:, MEMBERS:first_table].contiguous(),
                staged[:, PREFIX_KEYS].contiguous(),
                staged[:, PREFIX_START].contiguous(),
            )
        self.backend.prepare(
            AttnContext(
                slot_mapping_N=staged[:, SLOT],
                block_tables_SB=staged[:, first_table:],
                query_index_SQ=rows_S[:, None],
                query_pos_SQ=positions_S[:, None],
                output_index_N=rows_S,
                shared_prefix=prefix,
            )
        )
        tokens_S = staged[:, TOKEN]
        ids_S = tokens_S if pending_R is None else take_pending(tokens_S, pending_R)
        rope_S = positions_S if rope_delta_S is None else positions_S + rope_delta_S
        hidden_SD = self.model.hidden_states(ids_S, position_ids=rope_S, attn=self.backend)
        self._record_routes()
        return hidden_SD
