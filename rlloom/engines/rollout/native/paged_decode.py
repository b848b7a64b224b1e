"""Paged decode attention in Triton: one query token per sequence reads its keys through the block table.

The torch path (attention.py) gathers every sequence's keys and values into a padded copy before
SDPA, which moves each cached byte three times (read, write, read). This kernel reads each cached
key/value once, straight from its block, with an online softmax (Milakov & Gimelshein 2018, as in
FlashAttention): one program per (sequence, kv head) holds the G = Hq / Hkv query heads of that kv
head and walks the sequence's tokens TILE at a time.

Used on CUDA for every forward with one new token per sequence (decode), if Triton imports and the
known-answer check `decode_kernel_works` passes on the device; otherwise the torch path runs. The
kernel computes in fp32 and writes the output in q's dtype. On CPU it can be exercised with
TRITON_INTERPRET=1 (tests/engines/rollout/test_rollout_paged_decode.py).

Shape legend: S sequences, Hq/Hkv heads, G = Hq / Hkv, D/Dv head dims, B blocks per table row.
"""

# Triton reads a kernel's annotations as specialisation hints, so its pointer and stride arguments stay bare.
# ruff: noqa: ANN001

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch path is used
    triton = None

if triton is not None:

    @triton.jit
    def _paged_decode_kernel(
        q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, scale,
        stride_q_s, stride_q_h, stride_k_slot, stride_k_h, stride_v_slot, stride_v_h, stride_t_s,
        stride_o_s, stride_o_h,
        G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, DV: tl.constexpr,
        DV_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
    ):  # fmt: skip
        s = tl.program_id(0)
        kv_head = tl.program_id(1)
        num_keys = tl.load(lens_ptr + s)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D_PAD)
        dv = tl.arange(0, DV_PAD)
        t = tl.arange(0, TILE)
        heads = kv_head * G + g
        q_mask = (g[:, None] < G) & (d[None, :] < D)
        q = tl.load(q_ptr + s * stride_q_s + heads[:, None] * stride_q_h + d[None, :], mask=q_mask, other=0.0)
        q = q.to(tl.float32) * scale
        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, DV_PAD], tl.float32)
        for start in range(0, num_keys, TILE):
            pos = start + t
            valid = pos < num_keys
            block = tl.load(tables_ptr + s * stride_t_s + pos // BLOCK_SIZE, mask=valid, other=0)
            slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
            k_mask = valid[:, None] & (d[None, :] < D)
            k = tl.load(
                k_ptr + slot[:, None] * stride_k_slot + kv_head * stride_k_h + d[None, :],
                mask=k_mask,
                other=0.0,
            )
            scores = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)  # [G_PAD, TILE]
            scores = tl.where(valid[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v_mask = valid[:, None] & (dv[None, :] < DV)
            v = tl.load(
                v_ptr + slot[:, None] * stride_v_slot + kv_head * stride_v_h + dv[None, :],
                mask=v_mask,
                other=0.0,
            )
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
            m_i = m_new
        out = acc / l_i[:, None]
        o_mask = (g[:, None] < G) & (dv[None, :] < DV)
        tl.store(
            out_ptr + s * stride_o_s + heads[:, None] * stride_o_h + dv[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=o_mask,
        )


def paged_decode(
    q_SHD: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables_SB: torch.Tensor,
    num_keys_S: torch.Tensor,
    scale: float,
    block_size: int,
) -> torch.Tensor:
    """q [S, Hq, D] against the first num_keys_S[s] cached tokens of each sequence -> [S, Hq, Dv].

    k_cache [slots, Hkv, D], v_cache [slots, Hkv, Dv] (one layer); block_tables_SB [S, B] int64."""
    S, Hq, D = q_SHD.shape
    Hkv, Dv = k_cache.shape[1], v_cache.shape[2]
    G = Hq // Hkv
    g_pad, d_pad, dv_pad = (triton.next_power_of_2(x) for x in (G, D, Dv))
    # Keep the [G, TILE, D] product of one step near 8k fp32 values per program (registers).
    tile = max(16, min(64, 8192 // (g_pad * d_pad)))
    out = torch.empty(S, Hq, Dv, dtype=q_SHD.dtype, device=q_SHD.device)
    _paged_decode_kernel[(S, Hkv)](
        q_SHD, k_cache, v_cache, block_tables_SB, num_keys_S, out, scale,
        q_SHD.stride(0), q_SHD.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
        v_cache.stride(1), block_tables_SB.stride(0), out.stride(0), out.stride(1),
        G=G, G_PAD=g_pad, D=D, D_PAD=d_pad, DV=Dv, DV_PAD=dv_pad, BLOCK_SIZE=block_size, TILE=tile,
        num_warps=4,
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
        num_keys = torch.tensor([1, 16, 17, 40, 64], device=device)
        try:
            got = paged_decode(q, k, v, tables, num_keys, d**-0.5, block)
            want = reference_decode(q.float(), k.float(), v.float(), tables, num_keys, d**-0.5, block)
            error = (got.float() - want).abs().max().item()
            _checked[key] = error < (1e-4 if dtype == torch.float32 else 3e-2)
            if not _checked[key]:
                logger.warning(
                    "paged decode kernel is off by %.2e on %s; using the torch path", error, device
                )
        except Exception as err:  # noqa: BLE001 - any compile or launch failure means: use the torch path
            logger.warning("paged decode kernel failed on %s (%s); using the torch path", device, err)
            _checked[key] = False
    return _checked[key]
