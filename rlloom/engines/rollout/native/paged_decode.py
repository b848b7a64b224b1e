"""Paged decode attention in Triton: one query token per sequence reads its keys through the block table.

The torch path (attention.py) gathers every sequence's keys and values into a padded copy before
SDPA, which moves each cached byte three times (read, write, read). This kernel reads each cached
key/value once, straight from its block, with an online softmax (Milakov & Gimelshein 2018, as in
FlashAttention): one program per (sequence, kv head, split) holds the G = Hq / Hkv query heads of
that kv head (padded to the 16 rows tl.dot needs, so both products run on tensor cores) and walks
its tokens TILE at a time. With few sequences the keys are split into chunks (flash-decoding) whose
partial softmax results a second kernel combines (`num_splits`; the engine keeps 1, see `decode_config`).

The first version computed the products as broadcast-and-sum in fp32 on CUDA cores: 440-480 us a
layer at 256 sequences x ~400 keys on an H100, 0.29 of the copy bandwidth; the tensor-core version
runs the same in 182 us, 0.70 (benchmarks/profile_rollout.py). P is rounded to the cache dtype for
the P @ V product, as FlashAttention does; fp32 caches use exact (ieee) products.

Shared prompts (cascade attention): the n samples of a GRPO group share their prompt's full KV
blocks (prefix sharing, block_manager.py), and reading those blocks once per sample is most of the
bytes a decode step moves at short responses. With `shared_prefix`, a first kernel runs one program
per (group, kv head): it loads the queries of all the group's members (M members x G heads rows,
so tl.dot has at least 16 rows without padding) and walks the shared blocks once, storing each
row's partial softmax state (acc, max, sum). The per-sequence kernel then starts at the end of its
group's prefix and merges that state into its own before normalising. The host finds the groups
each step from the block tables (`shared_prefix_groups`). Rounding differs from the one-pass kernel
in the last bits (the sum is split at another point), so on CUDA a seeded sample can depend on
whether its group was still whole in that step, as with any split-K attention.

Used on CUDA for every forward with one new token per sequence (decode), if Triton imports and the
known-answer check `decode_kernel_works` passes on the device; otherwise the torch path runs. The
kernel accumulates in fp32 and writes the output in q's dtype. On CPU it can be exercised with
TRITON_INTERPRET=1 (tests/engines/rollout/test_rollout_paged_decode.py).

Shape legend: S sequences, Hq/Hkv heads, G = Hq / Hkv, D/Dv head dims, B blocks per table row.
"""

# Triton reads a kernel's annotations as specialisation hints, so its pointer and stride arguments stay bare.
# ruff: noqa: ANN001

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

logger = logging.getLogger(__name__)

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch path is used
    triton = None


@dataclass(slots=True)
class SharedPrefix:
    """Groups of decode sequences whose first blocks are the same (tensors on the cache's device;
    row g of the group tensors is group g, unused rows have 0 keys)."""

    members_GM: torch.Tensor
    """[G', M] int64 batch rows of each group's members, -1 past its size."""
    num_keys_G: torch.Tensor
    """[G'] int64 shared keys of each group (whole blocks), 0 for unused rows."""
    start_S: torch.Tensor
    """[S] int64 first key each sequence reads itself: its group's shared keys, 0 outside groups."""


def max_group_members(num_heads: int, num_kv_heads: int) -> int:
    """Members per group in the prefix kernel: M x G query rows = 32 (larger groups are split)."""
    g_pad = 1 << (num_heads // num_kv_heads - 1).bit_length()
    return max(1, 32 // g_pad)


def shared_prefix_groups(
    tables_SB: np.ndarray, positions_S: np.ndarray, block_size: int, max_members: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Host side of `SharedPrefix`: (members [S, M], num_keys [S], start [S]) int64 arrays.

    Sequences whose first block is the same are cut, in batch order, into runs of at most
    `max_members`; a run's shared keys are the leading blocks that all its members' tables have in
    common, up to the block each member writes this step (never shared: copy-on-write makes it
    private). Runs of one sequence, or with no common block, are dropped.
    """
    S = tables_SB.shape[0]
    members = np.full((S, max_members), -1, dtype=np.int64)
    num_keys = np.zeros(S, dtype=np.int64)
    start = np.zeros(S, dtype=np.int64)
    order = np.argsort(tables_SB[:, 0], kind="stable")
    first = tables_SB[order, 0]
    heads = np.flatnonzero(np.r_[True, first[1:] != first[:-1]])  # where each group starts in `order`
    sizes = np.diff(np.r_[heads, S])
    leader = np.repeat(order[heads], sizes)  # per position in `order`: its group's first row
    same = tables_SB[order] == tables_SB[leader]
    common = np.cumprod(same, axis=1).sum(axis=1)  # leading blocks equal to the leader's
    usable = np.minimum(common, positions_S[order] // block_size)  # blocks before the written one
    runs = [
        (lo, min(lo + max_members, head + size))
        for head, size in zip(heads.tolist(), sizes.tolist())
        if size > 1
        for lo in range(head, head + size, max_members)
    ]
    if not runs:
        return members, num_keys, start
    bounds = np.array(runs).ravel()  # min over each [lo, hi) (a sentinel makes hi = S valid)
    run_blocks = np.minimum.reduceat(np.r_[usable, 0], bounds)[::2]
    row = 0
    for (lo, hi), blocks in zip(runs, run_blocks.tolist()):
        if hi - lo < 2 or blocks == 0:
            continue
        rows = order[lo:hi]
        members[row, : hi - lo] = rows
        num_keys[row] = start[rows] = blocks * block_size
        row += 1
    return members, num_keys, start


if triton is not None:

    @triton.jit
    def _attend_tile(
        q, m_i, l_i, acc, k_ptr, v_ptr, table_ptr, pos, valid, kv_head, scale,
        stride_k_slot, stride_k_h, stride_v_slot, stride_v_h,
        D: tl.constexpr, D_PAD: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):  # fmt: skip
        """Online-softmax step of query rows q [R, D_PAD] over the keys at positions `pos` (those
        with `valid`) of one block table: returns the updated (max, sum, unnormalised output)."""
        d = tl.arange(0, D_PAD)
        dv = tl.arange(0, DV_PAD)
        block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=valid, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        k = tl.load(
            k_ptr + slot[:, None] * stride_k_slot + kv_head * stride_k_h + d[None, :],
            mask=valid[:, None] & (d[None, :] < D),
            other=0.0,
        )
        v = tl.load(
            v_ptr + slot[:, None] * stride_v_slot + kv_head * stride_v_h + dv[None, :],
            mask=valid[:, None] & (dv[None, :] < DV),
            other=0.0,
        )
        # Tensor cores: R >= 16 query rows (padding rows are zeros and never stored).
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [R, TILE]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        return m_new, l_i, acc

    @triton.jit
    def _shared_prefix_kernel(
        q_ptr, k_ptr, v_ptr, tables_ptr, members_ptr, group_keys_ptr, acc_ptr, ml_ptr, scale, Hq,
        stride_q_s, stride_q_h, stride_k_slot, stride_k_h, stride_v_slot, stride_v_h, stride_t_s,
        G: tl.constexpr, G_POW2: tl.constexpr, M: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr,
        D_PAD: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        TILE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):  # fmt: skip
        """One (group, kv head): the M x G query rows of the group's members (padded to ROWS >= 16
        for tl.dot) against the shared keys, read once; stores each row's unnormalised output and
        (max, sum) in fp32."""
        grp = tl.program_id(0)
        kv_head = tl.program_id(1)
        num_keys = tl.load(group_keys_ptr + grp)
        if num_keys == 0:
            return
        r = tl.arange(0, ROWS)
        gi = r % G_POW2
        in_group = r < M * G_POW2
        seq = tl.load(members_ptr + grp * M + r // G_POW2, mask=in_group, other=-1)
        valid = (gi < G) & (seq >= 0)
        seq = tl.maximum(seq, 0)
        heads = kv_head * G + gi
        d = tl.arange(0, D_PAD)
        dv = tl.arange(0, DV_PAD)
        t = tl.arange(0, TILE)
        q = tl.load(
            q_ptr + seq[:, None] * stride_q_s + heads[:, None] * stride_q_h + d[None, :],
            mask=valid[:, None] & (d[None, :] < D),
            other=0.0,
        )
        table = tables_ptr + tl.load(members_ptr + grp * M) * stride_t_s  # the shared blocks
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, DV_PAD], tl.float32)
        for start in range(0, num_keys, TILE):
            pos = start + t
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, k_ptr, v_ptr, table, pos, pos < num_keys, kv_head, scale,
                stride_k_slot, stride_k_h, stride_v_slot, stride_v_h,
                D, D_PAD, DV, DV_PAD, BLOCK_SIZE, DOT_PRECISION,
            )  # fmt: skip
        out_row = seq * Hq + heads
        tl.store(acc_ptr + out_row[:, None] * DV + dv[None, :], acc, mask=valid[:, None] & (dv[None, :] < DV))
        tl.store(ml_ptr + out_row * 2, m_i, mask=valid)
        tl.store(ml_ptr + out_row * 2 + 1, l_i, mask=valid)

    @triton.jit
    def _paged_decode_kernel(
        q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, part_acc_ptr, part_ml_ptr, scale,
        stride_q_s, stride_q_h, stride_k_slot, stride_k_h, stride_v_slot, stride_v_h, stride_t_s,
        stride_o_s, stride_o_h, start_ptr, prefix_acc_ptr, prefix_ml_ptr,
        new_k_ptr, new_v_ptr, new_slot_ptr, stride_nk_s, stride_nk_h, stride_nv_s, stride_nv_h, stride_slot,
        G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, DV: tl.constexpr,
        DV_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, CHUNK: tl.constexpr,
        NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_PREFIX: tl.constexpr,
        WRITE_NEW: tl.constexpr,
    ):  # fmt: skip
        s = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        num_keys = tl.load(lens_ptr + s)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D_PAD)
        dv = tl.arange(0, DV_PAD)
        t = tl.arange(0, TILE)
        heads = kv_head * G + g
        q_mask = (g[:, None] < G) & (d[None, :] < D)
        q = tl.load(q_ptr + s * stride_q_s + heads[:, None] * stride_q_h + d[None, :], mask=q_mask, other=0.0)
        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, DV_PAD], tl.float32)
        end = tl.minimum(num_keys, (split + 1) * CHUNK)
        first_key = split * CHUNK
        if HAS_PREFIX:  # keys before `first_key` were read by _shared_prefix_kernel (NUM_SPLITS = 1)
            first_key = tl.load(start_ptr + s)
        if WRITE_NEW:  # the program whose keys include the new token stores its k/v in the cache first
            if (num_keys - 1 >= first_key) & (num_keys - 1 < end):
                slot = tl.load(new_slot_ptr + s * stride_slot)
                k_new = tl.load(new_k_ptr + s * stride_nk_s + kv_head * stride_nk_h + d, mask=d < D)
                v_new = tl.load(new_v_ptr + s * stride_nv_s + kv_head * stride_nv_h + dv, mask=dv < DV)
                k_dst = k_ptr + slot * stride_k_slot + kv_head * stride_k_h + d
                v_dst = v_ptr + slot * stride_v_slot + kv_head * stride_v_h + dv
                tl.store(k_dst, k_new.to(k_ptr.dtype.element_ty), mask=d < D)
                tl.store(v_dst, v_new.to(v_ptr.dtype.element_ty), mask=dv < DV)
                tl.debug_barrier()  # the stores are visible to the block's loads below
        for start in range(first_key, end, TILE):
            pos = start + t
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, k_ptr, v_ptr, tables_ptr + s * stride_t_s, pos, pos < end, kv_head,
                scale, stride_k_slot, stride_k_h, stride_v_slot, stride_v_h,
                D, D_PAD, DV, DV_PAD, BLOCK_SIZE, DOT_PRECISION,
            )  # fmt: skip
        o_mask = (g[:, None] < G) & (dv[None, :] < DV)
        if HAS_PREFIX:  # merge the group's prefix state (none: m = -inf, l = 0, acc = 0)
            row = s * (tl.num_programs(1) * G) + heads
            in_group = (g < G) & (tl.zeros([G_PAD], tl.int64) + first_key > 0)
            m_p = tl.load(prefix_ml_ptr + row * 2, mask=in_group, other=float("-inf"))
            l_p = tl.load(prefix_ml_ptr + row * 2 + 1, mask=in_group, other=0.0)
            acc_p = tl.load(
                prefix_acc_ptr + row[:, None] * DV + dv[None, :],
                mask=in_group[:, None] & (dv[None, :] < DV),
                other=0.0,
            )
            m_new = tl.maximum(m_i, m_p)  # finite: every sequence reads its own last key
            alpha, beta = tl.exp(m_i - m_new), tl.exp(m_p - m_new)
            acc = acc * alpha[:, None] + acc_p * beta[:, None]
            l_i = l_i * alpha + l_p * beta
            m_i = m_new
        if NUM_SPLITS == 1:
            out = acc / l_i[:, None]
            tl.store(
                out_ptr + s * stride_o_s + heads[:, None] * stride_o_h + dv[None, :],
                out.to(out_ptr.dtype.element_ty),
                mask=o_mask,
            )
        else:  # partial results [S, Hq, NUM_SPLITS, (DV | m, l)]; an empty split leaves m = -inf, l = 0
            row = (s * (tl.num_programs(1) * G) + heads) * NUM_SPLITS + split
            tl.store(part_acc_ptr + row[:, None] * DV + dv[None, :], acc, mask=o_mask)
            tl.store(part_ml_ptr + row * 2, m_i, mask=g < G)
            tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=g < G)

    @triton.jit
    def _combine_splits_kernel(
        part_acc_ptr, part_ml_ptr, out_ptr, stride_o_s, stride_o_h, Hq,
        DV: tl.constexpr, DV_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    ):  # fmt: skip
        s = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.arange(0, SPLITS_PAD)
        dv = tl.arange(0, DV_PAD)
        row = (s * Hq + h) * NUM_SPLITS + sp
        m = tl.load(part_ml_ptr + row * 2, mask=sp < NUM_SPLITS, other=float("-inf"))
        lse_sum = tl.load(part_ml_ptr + row * 2 + 1, mask=sp < NUM_SPLITS, other=0.0)
        acc = tl.load(
            part_acc_ptr + row[:, None] * DV + dv[None, :],
            mask=(sp[:, None] < NUM_SPLITS) & (dv[None, :] < DV),
            other=0.0,
        )
        m_max = tl.max(m, axis=0)  # finite: the first split always holds a key
        w = tl.where(m > float("-inf"), tl.exp(m - m_max), 0.0)
        out = tl.sum(acc * w[:, None], axis=0) / tl.sum(lse_sum * w, axis=0)
        tl.store(
            out_ptr + s * stride_o_s + h * stride_o_h + dv, out.to(out_ptr.dtype.element_ty), mask=dv < DV
        )


def decode_config(num_seqs: int, num_kv_heads: int, max_keys: int) -> tuple[int, int]:
    """(tile, num_splits). Measured on an H100 (benchmarks/profile_rollout.py, 256 sequences x 8 kv
    heads, 128-640 keys): tile 64 with 4 warps reads the cache at 0.68 of the copy bandwidth and
    splitting only costs there. The split stays 1 for every batch: a sequence's output must not
    depend on the batch or the graph bucket it runs in (splitting changes the rounding), so seeded
    tokens are the same eagerly and through CUDA graphs. `num_splits` > 1 is for callers that
    accept that (few long sequences, where (sequence, kv head) programs cannot fill the GPU)."""
    return 64, 1


def _shared_prefix_parts(
    q_SHD: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables_SB: torch.Tensor,
    shared_prefix: SharedPrefix,
    scale: float,
    block_size: int,
    *,
    tile: int,
    num_warps: int,
    precision: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's shared keys read once for all its members: per sequence and query head the
    unnormalised output [S, Hq, Dv] and (max, sum) [S, Hq, 2] over the shared prefix, fp32, which
    the decode kernel merges with the sequence's own keys."""
    S, Hq, D = q_SHD.shape
    Hkv, Dv = k_cache.shape[1], v_cache.shape[2]
    G = Hq // Hkv
    d_pad, dv_pad = triton.next_power_of_2(D), triton.next_power_of_2(Dv)
    members, g_pow2 = shared_prefix.members_GM, triton.next_power_of_2(G)
    assert members.is_contiguous() and shared_prefix.start_S.is_contiguous(), "pass contiguous tensors"
    assert shared_prefix.num_keys_G.is_contiguous(), "pass contiguous tensors"
    prefix_acc = torch.empty(S, Hq, Dv, dtype=torch.float32, device=q_SHD.device)
    prefix_ml = torch.empty(S, Hq, 2, dtype=torch.float32, device=q_SHD.device)
    _shared_prefix_kernel[(members.shape[0], Hkv)](
        q_SHD, k_cache, v_cache, block_tables_SB, members, shared_prefix.num_keys_G, prefix_acc,
        prefix_ml, scale, Hq, q_SHD.stride(0), q_SHD.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), block_tables_SB.stride(0),
        G=G, G_POW2=g_pow2, M=members.shape[1], ROWS=max(16, members.shape[1] * g_pow2), D=D, D_PAD=d_pad, DV=Dv,
        DV_PAD=dv_pad, BLOCK_SIZE=block_size, TILE=tile, DOT_PRECISION=precision,
        num_warps=num_warps,
    )  # fmt: skip
    return prefix_acc, prefix_ml


def paged_decode(
    q_SHD: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables_SB: torch.Tensor,
    num_keys_S: torch.Tensor,
    scale: float,
    block_size: int,
    *,
    tile: int | None = None,
    num_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
    shared_prefix: SharedPrefix | None = None,
    prefix_tile: int = 32,
    prefix_warps: int = 4,
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """q [S, Hq, D] against the first num_keys_S[s] cached tokens of each sequence -> [S, Hq, Dv].

    k_cache [slots, Hkv, D], v_cache [slots, Hkv, Dv] (one layer); block_tables_SB [S, B] int64.
    tile / num_splits default to `decode_config` (keyword overrides are for benchmarks). With
    `shared_prefix`, each group's shared keys are read once for all its members (one split only).
    With `new_kv` = (k [S, Hkv, D], v [S, Hkv, Dv], slots [S] int64), the kernel first stores each
    sequence's new token (its last key, at `slots[s]`) in the cache, saving the separate writes."""
    S, Hq, D = q_SHD.shape
    Hkv, Dv = k_cache.shape[1], v_cache.shape[2]
    G = Hq // Hkv
    g_pad = max(16, triton.next_power_of_2(G))  # tl.dot needs 16 rows
    d_pad, dv_pad = triton.next_power_of_2(D), triton.next_power_of_2(Dv)
    if q_SHD.stride(2) != 1:
        q_SHD = q_SHD.contiguous()
    max_keys = block_tables_SB.shape[1] * block_size
    auto_tile, auto_splits = decode_config(S, Hkv, max_keys)
    tile = tile or auto_tile
    num_splits = num_splits or auto_splits
    chunk = tile * -(-max_keys // (tile * num_splits))
    num_splits = -(-max_keys // chunk)
    out = torch.empty(S, Hq, Dv, dtype=q_SHD.dtype, device=q_SHD.device)
    part_acc = part_ml = out
    if num_splits > 1:
        part_acc = torch.empty(S, Hq, num_splits, Dv, dtype=torch.float32, device=q_SHD.device)
        part_ml = torch.empty(S, Hq, num_splits, 2, dtype=torch.float32, device=q_SHD.device)
    extra = {} if num_stages is None else {"num_stages": num_stages}
    precision = "ieee" if q_SHD.dtype == torch.float32 else "tf32"
    start_S = prefix_acc = prefix_ml = num_keys_S  # placeholders when there is no shared prefix
    if shared_prefix is not None:
        if num_splits != 1:
            raise ValueError(f"paged_decode: shared_prefix needs num_splits=1, got {num_splits}")
        start_S = shared_prefix.start_S
        prefix_acc, prefix_ml = _shared_prefix_parts(
            q_SHD, k_cache, v_cache, block_tables_SB, shared_prefix, scale, block_size,
            tile=prefix_tile, num_warps=prefix_warps, precision=precision,
        )  # fmt: skip
    new_k, new_v, new_slots = new_kv if new_kv is not None else (q_SHD, q_SHD, num_keys_S)
    if new_kv is not None:
        assert new_k.stride(2) == 1 and new_v.stride(2) == 1, "pass k/v with contiguous head channels"
    _paged_decode_kernel[(S, Hkv, num_splits)](
        q_SHD, k_cache, v_cache, block_tables_SB, num_keys_S, out, part_acc, part_ml, scale,
        q_SHD.stride(0), q_SHD.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
        v_cache.stride(1), block_tables_SB.stride(0), out.stride(0), out.stride(1), start_S, prefix_acc,
        prefix_ml, new_k, new_v, new_slots, new_k.stride(0), new_k.stride(1), new_v.stride(0),
        new_v.stride(1), new_slots.stride(0),
        G=G, G_PAD=g_pad, D=D, D_PAD=d_pad, DV=Dv, DV_PAD=dv_pad, BLOCK_SIZE=block_size, TILE=tile,
        CHUNK=chunk, NUM_SPLITS=num_splits, DOT_PRECISION=precision, HAS_PREFIX=shared_prefix is not None,
        WRITE_NEW=new_kv is not None, num_warps=num_warps, **extra,
    )  # fmt: skip
    if num_splits > 1:
        _combine_splits_kernel[(S, Hq)](
            part_acc, part_ml, out, out.stride(0), out.stride(1), Hq,
            DV=Dv, DV_PAD=dv_pad, NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits),
            num_warps=1,
        )  # fmt: skip
    return out


def reference_decode(
    q_SHD: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables_SB: torch.Tensor,
    num_keys_S: torch.Tensor,
    scale: float,
    block_size: int,
) -> torch.Tensor:
    """The same attention by gathering the keys and one masked SDPA call (the torch path's math)."""
    S, Hq, _ = q_SHD.shape
    Hkv = k_cache.shape[1]
    key_pos = torch.arange(block_tables_SB.shape[1] * block_size, device=q_SHD.device)
    slots = block_tables_SB[:, key_pos // block_size] * block_size + key_pos % block_size
    k, v = k_cache[slots].transpose(1, 2), v_cache[slots].transpose(1, 2)
    q = q_SHD.reshape(S, Hkv, Hq // Hkv, -1)
    mask = (key_pos[None, :] < num_keys_S[:, None])[:, None, None, :]
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).reshape(
        S, Hq, -1
    )


_checked: dict[tuple[str, torch.dtype, int, int, int, int], bool] = {}


def decode_kernel_works(device: torch.device, dtype: torch.dtype, hq: int, hkv: int, d: int, dv: int) -> bool:
    """Known-answer check of the kernel against `reference_decode` on random data (once per shape)."""
    key = (str(device), dtype, hq, hkv, d, dv)
    if triton is None:
        return False
    if key not in _checked:
        gen = torch.Generator().manual_seed(0)
        block, num_blocks, S = 16, 24, 5
        k = torch.randn(num_blocks * block, hkv, d, generator=gen).to(device, dtype)
        v = torch.randn(num_blocks * block, hkv, dv, generator=gen).to(device, dtype)
        q = torch.randn(S, hq, d, generator=gen).to(device, dtype)
        tables = torch.randperm(num_blocks, generator=gen)[: S * 4].view(S, 4).to(device)
        num_keys = torch.tensor([1, 40, 17, 40, 64], device=device)
        # Sequences 1-4 share block 0 of sequence 1, and 3-4 also its block 1: with groups of at
        # most two, (1, 2) share one block (2 writes its block 1) and (3, 4) share two.
        tables[2:, 0] = tables[1, 0]
        tables[3:, 1] = tables[1, 1]
        groups = shared_prefix_groups(tables.cpu().numpy(), num_keys.cpu().numpy() - 1, block, 2)
        prefix = SharedPrefix(*(torch.from_numpy(a).to(device) for a in groups))
        # With new_kv the kernel writes each sequence's last key itself: start from a cache without them.
        last = (
            tables[torch.arange(S, device=device), (num_keys - 1) // block] * block + (num_keys - 1) % block
        )
        new_kv = (k[last], v[last], last)
        try:
            want = reference_decode(q.float(), k.float(), v.float(), tables, num_keys, d**-0.5, block)
            errors = []
            # the default configuration, a split one (flash-decoding), shared prefixes, cache writes
            for kw in (
                {},
                {"tile": 16, "num_splits": 3},
                {"shared_prefix": prefix},
                {"shared_prefix": prefix, "new_kv": new_kv},
                {"tile": 16, "num_splits": 3, "new_kv": new_kv},
            ):
                k_in, v_in = k, v
                if "new_kv" in kw:
                    k_in, v_in = k.clone(), v.clone()
                    k_in[last], v_in[last] = 0, 0
                out = paged_decode(q, k_in, v_in, tables, num_keys, d**-0.5, block, **kw).float()
                errors.append((out - want).abs().max().item())
                if not (torch.equal(k_in, k) and torch.equal(v_in, v)):
                    errors.append(float("inf"))  # a missing or misplaced cache write
            error = max(errors)
            _checked[key] = error < (1e-4 if dtype == torch.float32 else 3e-2)
            if not _checked[key]:
                logger.warning(
                    "paged decode kernel is off by %.2e on %s; using the torch path", error, device
                )
        except Exception as err:  # noqa: BLE001 - any compile or launch failure means: use the torch path
            logger.warning("paged decode kernel failed on %s (%s); using the torch path", device, err)
            _checked[key] = False
    return _checked[key]
