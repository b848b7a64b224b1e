"""Attention functions over the three input layouts a CausalLM accepts.

- padded: q/k/v [B, T, H, D] of a right-padded batch; plain causal attention. With right padding
  the causal mask already hides every pad key from every real query (pads come after the real
  tokens), so real positions are exact without an explicit mask, and the fast `is_causal` kernels
  stay usable. Outputs at pad positions are finite and meaningless.
- packed: q/k/v [N, H, D] of sequences laid back to back (`cu_seqlens` [S + 1]); block-diagonal
  causal attention, no token sees another sequence.
- backend: q/k/v [N, H, D] handed to a pluggable `attn` object (the rollout engine's paged KV
  cache): `attn.attn(layer_idx, q, k, v, scale) -> out`, k/v NOT repeated for GQA.

Packed kernels by device:
- CPU (the tested reference) and other cases: one causal SDPA per sequence. Measured on 2 CPU
  cores with SmolLM2 attention shapes (benchmarks/bench_models.py --cpu-packed), this beats one SDPA
  over the whole stream with a block-diagonal [N, N] mask at every size tried, e.g. 1.1 vs 2.2 ms
  at 256 tokens, 2.6 vs 24 ms for 32 sequences of 16 tokens, 101 vs 1927 ms at 4096 tokens (the
  masked call falls back to the math kernel), and its memory grows with the longest sequence only.
- CUDA with bf16/fp16 and equal q/v head dims: `torch.nn.attention.varlen.varlen_attn`
  (FlashAttention varlen; causal through window (-1, 0)); untested here (no GPU in CI).

Shape legend: B batch, T padded length, N packed tokens, S sequences, Hq query heads, Hkv key/value
heads, D head channels (Dqk for q/k, Dv for v).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F


class AttnBackend(Protocol):
    """The rollout engine's attention: it owns the KV cache and knows the sequence structure."""

    def attn(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor: ...


@dataclass(slots=True)
class AttnLayout:
    """How the tokens of one forward are arranged; built once per forward by CausalLM."""

    kind: str
    """'padded', 'packed' or 'backend'."""
    cu_seqlens: torch.Tensor | None = None
    """packed: [S + 1] int32 cumulative sequence lengths."""
    max_seqlen: int | None = None
    """packed: longest sequence (needed by the CUDA varlen kernel)."""
    backend: Any = None
    """backend: the object whose `.attn(...)` computes attention."""


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, layout: AttnLayout, layer_idx: int
) -> torch.Tensor:
    """Causal attention of q [.., Hq, Dqk] over k [.., Hkv, Dqk], v [.., Hkv, Dv] -> [.., Hq, Dv]."""
    if layout.kind == "backend":
        return layout.backend.attn(layer_idx, q, k, v, scale)
    if layout.kind == "padded":
        return padded_attention(q, k, v, scale)
    assert layout.kind == "packed", layout.kind
    return packed_attention(q, k, v, scale, layout.cu_seqlens, layout.max_seqlen)


def padded_attention(
    q_BTHD: torch.Tensor, k_BTHD: torch.Tensor, v_BTHD: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal SDPA over a (right-padded) batch -> [B, T, Hq, Dv]."""
    q, k, v = (x.transpose(1, 2) for x in (q_BTHD, k_BTHD, v_BTHD))
    out = F.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    return out.transpose(1, 2)


def check_right_padded(attention_mask_BT: torch.Tensor) -> None:
    """ValueError unless every row is ones then zeros (real tokens first, padding after)."""
    mask = attention_mask_BT.bool()
    if bool((mask[:, 1:] & ~mask[:, :-1]).any()):
        raise ValueError(
            "attention_mask must describe right padding (each row: True on the real tokens, then False); "
            "got a row with a real token after padding. Fix: right-pad the batch (RolloutBatch.padded() "
            "does) or pass a packed stream."
        )


def packed_attention(
    q_NHD: torch.Tensor,
    k_NHD: torch.Tensor,
    v_NHD: torch.Tensor,
    scale: float,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None = None,
) -> torch.Tensor:
    """Block-diagonal causal attention over a packed stream -> [N, Hq, Dv]."""
    if (
        q_NHD.is_cuda
        and q_NHD.dtype in (torch.bfloat16, torch.float16)
        and q_NHD.shape[-1] == v_NHD.shape[-1]
    ):
        return _varlen_cuda(q_NHD, k_NHD, v_NHD, scale, cu_seqlens, max_seqlen)
    gqa = q_NHD.shape[1] != k_NHD.shape[1]
    return _per_sequence(q_NHD, k_NHD, v_NHD, scale, cu_seqlens.tolist(), gqa)


def _per_sequence(
    q_NHD: torch.Tensor, k_NHD: torch.Tensor, v_NHD: torch.Tensor, scale: float, cu: list[int], gqa: bool
) -> torch.Tensor:
    outs = []
    for start, end in zip(cu[:-1], cu[1:]):
        q, k, v = (x[start:end].transpose(0, 1) for x in (q_NHD, k_NHD, v_NHD))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        outs.append(out.transpose(0, 1))
    return torch.cat(outs, dim=0)


def _varlen_cuda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None,
) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    if max_seqlen is None:
        max_seqlen = int((cu[1:] - cu[:-1]).max())
    return varlen_attn(
        q,
        k,
        v,
        cu,
        cu,
        max_seqlen,
        max_seqlen,
        scale=scale,
        window_size=(-1, 0),
        enable_gqa=q.shape[1] != k.shape[1],
    )
