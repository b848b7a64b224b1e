"""DeepSeek-V3 multi-head latent attention (MLA), DeepSeek-V2 paper (arXiv 2405.04434), section 2.1.

Queries: x -> wq (or the low-rank wq_a -> RMSNorm -> wq_b) -> per head [nope | rope] channels.
Keys/values: x -> wkv_a -> [latent c_kv (kv_lora_rank) | shared rope key k_pe (qk_rope_head_dim)];
c_kv -> RMSNorm -> wkv_b -> per head [k_nope | v]. The rope key is shared by all heads.

Two forms of the same function:
- training (padded/packed/tree layouts): k/v are expanded per head before attention (no weight
  absorption): k [.., H, Dqk], v [.., H, Dv].
- rollout (the paged-attention backend): the key up-projection is absorbed into the query and the
  value up-projection into the output, so attention runs against the compressed latent itself, as
  multi-query attention with one cached "head" per token of R + Dr channels ([normed c_kv | roped
  k_pe]) whose values are its first R channels. That is what the KV cache holds: 576 numbers per
  token and layer for DeepSeek-V3 instead of 128 heads x (192 + 128) expanded. The scores are the
  same sums, q_nope . (W_uk c) = (W_uk^T q_nope) . c, taken in another order. Under
  `rollout.match_training` (models/exact.py) training takes this form as well. With YaRN the
softmax scale is qk_head_dim^-0.5 * mscale(factor, mscale_all_dim)^2, as in the reference code.
The two latent norms use eps 1e-6 regardless of rms_norm_eps, as the reference does.

Shape legend: `..` token dims, H heads, E hidden.
"""

from __future__ import annotations

import torch
from torch import nn

from rlloom.models.args import ModelArgs
from rlloom.models.attention_ops import AttnLayout, attend
from rlloom.models.exact import is_exact
from rlloom.models.layers import RMSNorm, apply_rope, yarn_mscale


class MLAttention(nn.Module):
    """Multi-head latent attention with optional query LoRA."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        assert args.mla is not None
        m = args.mla
        self.num_heads = args.num_heads
        self.nope_dim, self.rope_dim, self.v_dim = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        self.kv_lora_rank = m.kv_lora_rank
        qk_dim = self.nope_dim + self.rope_dim
        dim, bias = args.hidden_size, args.attention_bias
        if m.q_lora_rank is None:
            self.wq = nn.Linear(dim, self.num_heads * qk_dim, bias=False)
        else:
            self.wq_a = nn.Linear(dim, m.q_lora_rank, bias=bias)
            self.q_norm = RMSNorm(m.q_lora_rank, 1e-6)
            self.wq_b = nn.Linear(m.q_lora_rank, self.num_heads * qk_dim, bias=False)
        self.wkv_a = nn.Linear(dim, m.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_norm = RMSNorm(m.kv_lora_rank, 1e-6)
        self.wkv_b = nn.Linear(m.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim), bias=False)
        self.wo = nn.Linear(self.num_heads * self.v_dim, dim, bias=bias)
        self.scale = qk_dim**-0.5
        r = args.rope
        if r.rope_type != "default" and r.mscale_all_dim:
            self.scale *= yarn_mscale(r.factor, r.mscale_all_dim) ** 2
        self.interleaved = r.interleaved
        self.has_q_lora = m.q_lora_rank is not None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: AttnLayout
    ) -> torch.Tensor:
        """x [.., E], cos/sin [.., qk_rope_head_dim] -> [.., E]."""
        q = self.wq_b(self.q_norm(self.wq_a(x))) if self.has_q_lora else self.wq(x)
        q = q.unflatten(-1, (self.num_heads, self.nope_dim + self.rope_dim))
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        c_kv, k_pe = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        # rollout.match_training: training takes the rollout's form too, so a token's sums are the same
        if layout.kind == "backend" or is_exact():
            return self._latent_attention(q_nope, q_pe, c_kv, k_pe, cos, sin, layout)
        kv = self.wkv_b(self.kv_norm(c_kv)).unflatten(-1, (self.num_heads, self.nope_dim + self.v_dim))
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        q_pe = apply_rope(q_pe, cos, sin, interleaved=self.interleaved)
        k_pe = apply_rope(k_pe.unsqueeze(-2), cos, sin, interleaved=self.interleaved)
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(*k_nope.shape[:-1], self.rope_dim)], dim=-1)
        out = attend(q, k, v.contiguous(), self.scale, layout)
        return self.wo(out.flatten(-2))

    def _latent_attention(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        c_kv: torch.Tensor,
        k_pe: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layout: AttnLayout,
    ) -> torch.Tensor:
        """The absorbed form (module docstring): q [N, H, R + Dr] against the latent k [N, 1, R + Dr],
        v [N, 1, R] (the backend caches k; v is its first R channels) -> [N, E]."""
        latent = self.kv_norm(c_kv)
        w_uk, w_uv = self.wkv_b.weight.unflatten(0, (self.num_heads, -1)).split(
            [self.nope_dim, self.v_dim], 1
        )
        q_latent = torch.einsum("nhd,hdr->nhr", q_nope, w_uk)
        q_pe = apply_rope(q_pe, cos, sin, interleaved=self.interleaved)
        k_pe = apply_rope(k_pe.unsqueeze(-2), cos, sin, interleaved=self.interleaved)
        q = torch.cat([q_latent, q_pe], dim=-1)
        k = torch.cat([latent.unsqueeze(-2), k_pe], dim=-1)
        # The values as a view of the keys' first R channels, as the rollout's cache holds them: the
        # exact CUDA kernel then reads them in place on both sides (models/exact_attention.py).
        out_latent = attend(q, k, k[..., : self.kv_lora_rank], self.scale, layout)
        return self.wo(torch.einsum("nhr,hvr->nhv", out_latent, w_uv).flatten(-2))
