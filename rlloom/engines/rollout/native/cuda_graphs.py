"""DecodeGraphs: the decode forward captured in CUDA graphs, replayed with padded batches.

One graph per (batch size, key-block bucket), captured on first use. Batch sizes are 1, 2, 4, 8,
then every 16 up to max_num_seqs; key buckets are the block counts covering 128, 256, 384, ...
tokens up to max_model_len, so the torch attention path gathers at most 128 key slots more than the
step's longest sequence needs; with the Triton decode kernel, which reads only each sequence's own
keys, there is one bucket. A step pads its batch to the nearest captured size: padded rows read and
write only the scratch block (the block after the cache's last real block), never used otherwise.

`forward` (default: the model's own `hidden_states`) is what gets captured: the runner passes a
torch.compile'd one. Compiled graphs start at batch size 2 (a batch of 1 pads to 2), because a
dynamic-shape compilation specialises size 1 and would compile the whole model again for it.

All graphs share one memory pool and read their inputs from static buffers that `run` fills before
`replay`. A graph is captured with the current step's inputs already in the buffers, so its warm-up
forward writes exactly the keys/values the replay then writes again. The weights and the KV cache
are read at the addresses they had at capture: update weights in place (`load_hf_tensors`) and
start a new DecodeGraphs after anything reallocates them (the engine's wake()).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from rlloom.devices import to_device
from rlloom.engines.rollout.native.attention import AttnContext, PagedAttention
from rlloom.engines.rollout.native.paged_decode import SharedPrefix, max_group_members
from rlloom.engines.rollout.native.sequence import take_pending

logger = logging.getLogger(__name__)

# Columns of a decode step's host rows (built by `ModelRunner._decode_rows`, read by `run` below):
# per sequence s its last token, that token's position and cache slot and the first key it reads
# itself (after its group's shared prefix); then group s's shared keys and its M members (see
# paged_decode.SharedPrefix); then the block table.
TOKEN, POSITION, SLOT, PREFIX_START, PREFIX_KEYS, MEMBERS = range(6)


def table_column(max_members: int) -> int:
    """The first block-table column of decode rows with groups of up to `max_members`."""
    return MEMBERS + max_members


def _batch_sizes(max_num_seqs: int, smallest: int = 1) -> list[int]:
    sizes = {b for b in (1, 2, 4, 8) if smallest <= b <= max_num_seqs} | set(range(16, max_num_seqs + 1, 16))
    return sorted(sizes | {max_num_seqs})


def _block_buckets(max_blocks: int, block_size: int, step_tokens: int = 128) -> list[int]:
    buckets = {
        min(max_blocks, -(-tokens // block_size))
        for tokens in range(step_tokens, max_blocks * block_size, step_tokens)
    }
    return sorted(buckets | {max_blocks})


class GraphCaptureError(RuntimeError):
    """The model cannot be captured (e.g. a layer that reads a device value on the host)."""


class DecodeGraphs:
    def __init__(
        self,
        model: nn.Module,
        backend: PagedAttention,
        *,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        scratch_block: int,
        bucket_tokens: int = 128,
        forward: Callable[..., torch.Tensor] | None = None,
        route_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.route_dtype = route_dtype
        """MoE models: the experts each row used are captured too, as a second output in this dtype."""
        self.backend = backend
        self.forward = model.hidden_states if forward is None else forward
        self.batch_sizes = _batch_sizes(max_num_seqs, smallest=1 if forward is None else 2)
        self.block_buckets = (
            [max_blocks_per_seq]
            if backend.use_decode_kernel
            else _block_buckets(max_blocks_per_seq, backend.block_size, bucket_tokens)
        )
        self.scratch_block = scratch_block
        device = backend.k_cache.device
        max_bs = self.batch_sizes[-1]
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=device)
        # A vision-language model's rotary positions are the cache positions shifted per sequence
        # (M-RoPE's delta, filled by `run`); a text model's are the cache positions themselves.
        self.rope_positions = (
            torch.zeros(max_bs, dtype=torch.int64, device=device) if model.args.vision else self.positions
        )
        self.slot_mapping = torch.full((max_bs,), scratch_block * backend.block_size, device=device)
        self.block_tables = torch.full((max_bs, max_blocks_per_seq), scratch_block, device=device)
        self.max_members = max_members = max_group_members(
            model.args.num_heads, model.args.kv_cache.num_heads
        )
        self.members = torch.full((max_bs, max_members), -1, device=device)
        self.prefix_keys = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.prefix_start = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.rows = torch.arange(max_bs, device=device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.pool = None

    def _forward(self, bs: int, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.backend.prepare(
            AttnContext(
                slot_mapping_N=self.slot_mapping[:bs],
                block_tables_SB=self.block_tables[:bs, :num_blocks],
                query_index_SQ=self.rows[:bs, None],
                query_pos_SQ=self.positions[:bs, None],
                output_index_N=self.rows[:bs],
                shared_prefix=SharedPrefix(self.members[:bs], self.prefix_keys[:bs], self.prefix_start[:bs])
                if self.backend.use_decode_kernel
                else None,
            )
        )
        hidden = self.forward(self.input_ids[:bs], position_ids=self.rope_positions[:bs], attn=self.backend)
        # The MoE layers keep their last experts as attributes: stacking them here makes the copy a
        # kernel of the graph, so every replay refreshes this output.
        routes = None if self.route_dtype is None else self.model.last_routes().to(self.route_dtype)
        return hidden, routes

    def warm_up(self, bs: int, num_blocks: int) -> None:
        """The forward of `bs` rows with what the buffers hold, outside any graph: compilation, lazy
        kernel and cuBLAS set-up. Before any step the buffers hold padding: every row writes only the
        scratch block."""
        try:
            self._forward(bs, num_blocks)
        except Exception as err:  # noqa: BLE001 - e.g. an Inductor failure: the caller falls back
            raise GraphCaptureError(f"the decode forward (batch {bs}) failed before capture: {err}") from err

    def _capture(self, bs: int, num_blocks: int) -> None:
        start = time.perf_counter()
        self.warm_up(bs, num_blocks)
        torch.cuda.synchronize()
        warm_s = time.perf_counter() - start
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[(bs, num_blocks)] = self._forward(bs, num_blocks)
        except RuntimeError as err:
            raise GraphCaptureError(
                f"capturing the decode forward (batch {bs}, {num_blocks} blocks) failed: {err}"
            ) from err
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[(bs, num_blocks)] = graph
        torch.cuda.synchronize()
        logger.info(
            "decode graph (batch %d, %d blocks) captured in %.2f s (warm-up %.2f s)",
            bs, num_blocks, time.perf_counter() - start, warm_s,
        )  # fmt: skip

    def fits(self, batch_size: int, width: int) -> bool:
        return batch_size <= self.batch_sizes[-1] and width <= self.block_buckets[-1]

    @torch.no_grad()
    def run(
        self,
        rows: np.ndarray,
        pending_R: torch.Tensor | None = None,
        rope_delta_B: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Final hidden states [B, D] of one decode step and, for MoE, the experts each row used
        [B, MoE layers, K] (else None); rows [B, table_column(M) + width] int64
        in the column layout above (tables padded with the scratch block). With `pending_R`, token
        -1 - r stands for `pending_R[r]` (the step in flight's sampled tokens). A vision-language
        model passes `rope_delta_B` (device, int64): row b's rotary position is its position + delta."""
        first_table = table_column(self.max_members)
        B, width = rows.shape[0], rows.shape[1] - first_table
        bs = next(b for b in self.batch_sizes if b >= B)
        num_blocks = next(n for n in self.block_buckets if n >= width)
        staged = np.full((bs, first_table + num_blocks), self.scratch_block, dtype=np.int64)
        staged[:B, : first_table + width] = rows
        # Padded rows: token 0 at position 0, written to the scratch block, in no group.
        staged[B:, :MEMBERS] = [0, 0, self.scratch_block * self.backend.block_size, 0, 0]
        staged[B:, MEMBERS:first_table] = -1
        staged_t = to_device(torch.from_numpy(staged), self.input_ids.device)
        ids = staged_t[:, TOKEN] if pending_R is None else take_pending(staged_t[:, TOKEN], pending_R)
        self.input_ids[:bs].copy_(ids)
        self.positions[:bs].copy_(staged_t[:, POSITION])
        if self.rope_positions is not self.positions:
            assert rope_delta_B is not None, "a vision-language decode needs its rotary deltas"
            self.rope_positions[:bs].copy_(staged_t[:, POSITION])
            self.rope_positions[:B] += rope_delta_B
        self.slot_mapping[:bs].copy_(staged_t[:, SLOT])
        self.prefix_start[:bs].copy_(staged_t[:, PREFIX_START])
        self.prefix_keys[:bs].copy_(staged_t[:, PREFIX_KEYS])
        self.members[:bs].copy_(staged_t[:, MEMBERS:first_table])
        self.block_tables[:bs, :num_blocks].copy_(staged_t[:, first_table:])
        if (bs, num_blocks) not in self.graphs:
            self._capture(bs, num_blocks)
        self.graphs[(bs, num_blocks)].replay()
        hidden, routes = self.outputs[(bs, num_blocks)]
        return hidden[:B], None if routes is None else routes[:B]
