"""Grouped-query self-attention (Llama, Qwen2 with q/k/v bias, Qwen3 with per-head QK-norm).

The module projects, normalises (Qwen3) and rotates q/k, then hands q [.., Hq, D] and the
un-repeated k/v [.., Hkv, D] to `attention_ops.attend`, which picks the kernel for the layout.

Shape legend: `..` token dims ([B, T] padded or [N] packed), Hq/Hkv heads, D head_dim, E hidden.
"""

from __future__ import annotations

import torch
from torch import nn

from rlloom.models.args import ModelArgs
from rlloom.models.attention_ops import AttnLayout, attend
from rlloom.models.layers import FusedLinear, RMSNorm, apply_rope


class Attention(nn.Module):
    """GQA attention with optional q/k/v (and output) biases and optional QK-norm; with
    `args.fused_projections` q/k/v are one `FusedLinear` (wqkv)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} must be a multiple of num_key_value_heads="
                f"{self.num_kv_heads} for grouped-query attention. Fix: correct config.json."
            )
        dim, hd = args.hidden_size, args.head_dim
        widths = {"wq": self.num_heads * hd, "wk": self.num_kv_heads * hd, "wv": self.num_kv_heads * hd}
        self.fused = args.fused_projections
        if self.fused:
            self.wqkv = FusedLinear(dim, widths, bias=args.attention_bias)
        else:
            self.wq, self.wk, self.wv = (nn.Linear(dim, w, bias=args.attention_bias) for w in widths.values())
        self.wo = nn.Linear(self.num_heads * hd, dim, bias=args.attention_out_bias)
        self.q_norm = RMSNorm(hd, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(hd, args.rms_norm_eps) if args.qk_norm else None
        self.scale = hd**-0.5

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: AttnLayout
    ) -> torch.Tensor:
        """x [.., E], cos/sin [.., D] -> [.., E]."""
        q, k, v = self.wqkv.forward_parts(x) if self.fused else (self.wq(x), self.wk(x), self.wv(x))
        q = q.unflatten(-1, (self.num_heads, self.head_dim))
        k = k.unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = v.unflatten(-1, (self.num_kv_heads, self.head_dim))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attend(q, k, v, self.scale, layout)
        return self.wo(out.flatten(-2))
