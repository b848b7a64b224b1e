"""PagedAttention: the attention backend the model calls during rollout; it owns the paged KV cache.

`CausalLM.hidden_states(input_ids_N, position_ids=..., attn=backend)` calls
`backend.attn(q [N, Hq, D], k [N, Hkv, D], v [N, Hkv, Dv], scale)` for every layer, in order
(the backend counts the calls since `prepare` to know the layer). The
backend writes the new k/v into the cache at `slot_mapping`, gathers each sequence's keys and values
(cached prefix included) through its block table, and runs one SDPA call for the whole batch with a
causal mask per sequence. Prefill (many queries per sequence) and decode (one) take the same path.

Grouped-query attention without repeating k/v: the G = Hq / Hkv query heads that share a kv head are
folded into the query-length axis, q [S, Hkv, Q * G, D] against k [S, Hkv, K, D].

The gather reads every key slot up to the key length K of the batch (on GPU the decode forward is
captured in CUDA graphs with K fixed per graph, cuda_graphs.py) and copies it once more. With
`use_decode_kernel` (CUDA, when paged_decode.py's Triton kernel passes its check) forwards of one
token per sequence read the cache through the block table instead, each byte once, and the kernel
stores the new k/v itself (two fewer launches a layer). Both paths are graph-safe (no host syncs,
no data-dependent shapes).

The model reaches the cache through one custom op, `rlloom::paged_attention(q, k, v, handle,
layer, scale)`: the op looks the backend up by its handle and runs `PagedAttention.run_layer`; to
torch.compile it is opaque (its fake returns an empty [N, Hq, Dv]), so the cache writes and the
Triton kernel stay outside Inductor, and the KV cache is never a graph input that the compiler would
copy to functionalise its mutation (vLLM's attention op does the same). A runner keeps one handle
across sleep/wake, so a re-allocated cache needs no recompilation. The model passes no layer index:
`attn` counts its calls since `prepare`. The compiled decode forward (model_runner.py) is one graph
per decoder layer, shared by all layers: the layers see the backend through `PiecewiseAttention`,
whose `attn` is a deliberate graph break (vLLM's piecewise compilation splits at attention the same
way); no index crosses it, so no index becomes a constant of a traced frame, and Dynamo traces one
layer instead of the whole model.

Under rollout.match_training on CUDA (`is_exact()` at `prepare`), every forward, prefill or decode,
runs the training forward's batch-invariant kernel instead (models/exact_attention.py): each
sequence is a run whose keys are its slots in position order (`paged_runs`), so a token's output is
the bits training computes for it.

Shape legend: N new tokens, S sequences, Q most new tokens of a sequence (1 in decode), K key slots
gathered per sequence (a multiple of the block size), Hq/Hkv heads, G = Hq / Hkv, D/Dv head dims.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from rlloom.engines.rollout.native.paged_decode import SharedPrefix, paged_decode
from rlloom.models.exact import is_exact, uses_kernels

if TYPE_CHECKING:
    from rlloom.models.exact_attention import Runs


@dataclass(slots=True)
class AttnContext:
    """Where one forward's tokens go and what they see (tensors on the cache's device)."""

    slot_mapping_N: torch.Tensor
    """[N] int64 cache slot receiving each new token's k/v."""
    block_tables_SB: torch.Tensor
    """[S, K / block_size] int64 blocks of each sequence (entries past its length: any valid block)."""
    query_index_SQ: torch.Tensor
    """[S, Q] int64 index in N of each sequence's i-th new token (padding: 0)."""
    query_pos_SQ: torch.Tensor
    """[S, Q] int64 position of that token in its sequence (padding: 0, so no row is fully masked)."""
    output_index_N: torch.Tensor
    """[N] int64 index of each new token in the flattened [S * Q] query grid."""
    shared_prefix: SharedPrefix | None = None
    """Decode only: groups whose shared prompt blocks the Triton kernel reads once (paged_decode.py);
    the torch path ignores it (it reads every sequence's keys itself, with the same result)."""


_PREFILL_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""Every SDPA backend but cuDNN's: it builds a graph for each new shape on the host (1.8 ms a layer
on an H200), and a prefill's shape is new almost every time (0.1 s of host time per prefill step of
a 28-layer model, against 14 ms on the device; measured with the torch profiler)."""

_handles = itertools.count()
_backends: weakref.WeakValueDictionary[int, PagedAttention] = weakref.WeakValueDictionary()


def new_handle() -> int:
    """A fresh backend handle (the key `rlloom::paged_attention` finds a backend by)."""
    return next(_handles)


@torch.library.custom_op("rlloom::paged_attention", mutates_args=())
def paged_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, handle: int, layer: int, scale: float
) -> torch.Tensor:
    """Attention of one layer through the backend registered under `handle` (writes its KV cache)."""
    return _backends[handle].run_layer(layer, q, k, v, scale)


@paged_attention_op.register_fake
def _paged_attention_fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, handle: int, layer: int, scale: float
) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1], v.shape[2])


class PagedAttention:
    def __init__(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_size: int,
        *,
        use_decode_kernel: bool = False,
        handle: int | None = None,
    ) -> None:
        """k_cache [L, slots, Hkv, D], v_cache [L, slots, Hkv, Dv]; slot = block * block_size + offset.
        `v_cache` may be a view of k_cache's first Dv channels (MLA's latent: the values are part of
        the keys), then only the keys are written. `handle` (from `new_handle()`) replaces an earlier
        backend of the same handle."""
        self.handle = new_handle() if handle is None else handle
        _backends[self.handle] = self
        self.k_cache = k_cache
        self.v_cache = v_cache
        self.block_size = block_size
        self.use_decode_kernel = use_decode_kernel
        self.values_in_keys = v_cache.untyped_storage().data_ptr() == k_cache.untyped_storage().data_ptr()
        self.context: AttnContext | None = None
        self._layer = 0
        """The layer the next `attn` call is for (calls since `prepare`)."""
        self._num_keys_S: torch.Tensor | None = None
        self._kv_slots_SK: torch.Tensor | None = None
        self._mask_S1QK: torch.Tensor | None = None
        self._exact_runs: Runs | None = None
        """rollout.match_training on CUDA: this forward's sequences as the exact kernel's runs."""

    def caches(self) -> list[torch.Tensor]:
        """The tensors that hold the cache (the keys alone when the values are a view of them)."""
        return [self.k_cache] if self.values_in_keys else [self.k_cache, self.v_cache]

    def prepare(self, context: AttnContext) -> None:
        """Set the context of the next forward and derive the per-batch gather index and mask."""
        self.context = context
        self._layer = 0
        self._exact_runs = None
        if is_exact() and uses_kernels(context.block_tables_SB):
            self._exact_runs = paged_runs(context, self.block_size)
            return
        if self.use_decode_kernel and context.query_pos_SQ.shape[1] == 1:
            self._num_keys_S = context.query_pos_SQ[:, 0] + 1
            return
        self._num_keys_S = None
        num_keys = context.block_tables_SB.shape[1] * self.block_size
        key_pos_K = torch.arange(num_keys, device=context.block_tables_SB.device)
        self._kv_slots_SK = (
            context.block_tables_SB[:, key_pos_K // self.block_size] * self.block_size
            + key_pos_K % self.block_size
        )
        self._mask_S1QK = (key_pos_K[None, None, :] <= context.query_pos_SQ[:, :, None]).unsqueeze(1)

    def attn(
        self, q_NHD: torch.Tensor, k_NHD: torch.Tensor, v_NHD: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """-> [N, Hq, Dv] for the next layer of this forward; also stores k/v of the new tokens in
        that layer's cache (the model's entry point)."""
        layer = self._layer
        if self.context is None or layer >= self.k_cache.shape[0]:
            raise RuntimeError(
                f"PagedAttention.attn: call {layer + 1} since prepare(), but the cache has "
                f"{self.k_cache.shape[0]} layers: call prepare() before every forward"
            )
        self._layer += 1
        if is_exact():  # rollout.match_training: its numerics must reach the op's body (eager)
            return self.run_layer(layer, q_NHD, k_NHD, v_NHD, scale)
        return paged_attention_op(q_NHD, k_NHD, v_NHD, self.handle, layer, scale)

    def run_layer(
        self, layer: int, q_NHD: torch.Tensor, k_NHD: torch.Tensor, v_NHD: torch.Tensor, scale: float
    ) -> torch.Tensor:
        ctx = self.context
        assert ctx is not None
        k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]
        k_NHD, v_NHD = k_NHD.to(k_cache.dtype), v_NHD.to(v_cache.dtype)
        if self._exact_runs is not None:  # the training forward's kernel (models/exact_attention.py)
            from rlloom.models.exact_attention import attend_runs  # Triton: imported where it runs

            k_cache.index_copy_(0, ctx.slot_mapping_N, k_NHD)
            if not self.values_in_keys:
                v_cache.index_copy_(0, ctx.slot_mapping_N, v_NHD)
            return attend_runs(q_NHD.to(k_cache.dtype), k_cache, v_cache, scale, self._exact_runs)
        if self._num_keys_S is not None:
            # One query per sequence: query_index and output_index are the identity here, and the
            # kernel stores the new k/v in the cache itself.
            return paged_decode(
                q_NHD.to(k_cache.dtype), k_cache, v_cache, ctx.block_tables_SB, self._num_keys_S, scale,
                self.block_size, shared_prefix=ctx.shared_prefix, new_kv=(k_NHD, v_NHD, ctx.slot_mapping_N),
            )  # fmt: skip
        k_cache.index_copy_(0, ctx.slot_mapping_N, k_NHD)
        if not self.values_in_keys:
            v_cache.index_copy_(0, ctx.slot_mapping_N, v_NHD)
        assert self._kv_slots_SK is not None and self._mask_S1QK is not None

        S, Q = ctx.query_index_SQ.shape
        Hq, Hkv = q_NHD.shape[1], k_NHD.shape[1]
        G = Hq // Hkv
        q = (
            q_NHD[ctx.query_index_SQ]
            .reshape(S, Q, Hkv, G, -1)
            .permute(0, 2, 1, 3, 4)
            .reshape(S, Hkv, Q * G, -1)
        )
        k = k_cache[self._kv_slots_SK].transpose(1, 2)
        v = v_cache[self._kv_slots_SK].transpose(1, 2)
        mask = self._mask_S1QK  # [S, 1, Q, K]; with Q = 1 it broadcasts over the G folded heads
        if G > 1 and Q > 1:
            mask = mask.unsqueeze(3).expand(S, 1, Q, G, mask.shape[-1]).reshape(S, 1, Q * G, -1)
        with sdpa_kernel(_PREFILL_BACKENDS):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out = out.reshape(S, Hkv, Q, G, -1).permute(0, 2, 1, 3, 4).reshape(S * Q, Hq, -1)
        return out[ctx.output_index_N]


def paged_runs(ctx: AttnContext, block_size: int) -> Runs:
    """The exact kernel's runs of a paged forward: sequence s is run s, its new tokens (rows
    query_index_SQ[s, 0].. of the stream, consecutive positions from query_pos_SQ[s, 0]) the run's
    queries, and the slots of its positions 0, 1, ... (through its block table) the run's keys."""
    from rlloom.models.exact_attention import Runs, int32  # Triton: imported where it runs

    S, Q = ctx.query_index_SQ.shape
    tables_SB = ctx.block_tables_SB
    num_keys = tables_SB.shape[1] * block_size
    key_pos_K = torch.arange(num_keys, device=tables_SB.device)
    slots_SK = tables_SB[:, key_pos_K // block_size] * block_size + key_pos_K % block_size
    first_pos_S = ctx.query_pos_SQ[:, 0]
    # Padding entries hold position 0, never first + i for i >= 1.
    in_run_SQ = ctx.query_pos_SQ == first_pos_S[:, None] + torch.arange(Q, device=tables_SB.device)
    q_len_S = in_run_SQ.sum(dim=1)
    k_base_S = torch.arange(S, device=tables_SB.device) * num_keys
    return Runs(
        int32(ctx.query_index_SQ[:, 0]),
        int32(q_len_S),
        int32(k_base_S),
        int32(first_pos_S + q_len_S),
        int32(slots_SK.reshape(-1)),
        Q,
    )


class PiecewiseAttention:
    """A backend seen through a graph break: per-layer compiled code calls it (module docstring)."""

    def __init__(self, backend: PagedAttention) -> None:
        self.backend = backend

    @torch.compiler.disable
    def attn(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        return self.backend.attn(q, k, v, scale)
