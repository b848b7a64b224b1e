"""Building blocks shared by every architecture: RMSNorm, rotary embeddings, the SwiGLU MLP.

The math follows the Hugging Face reference implementations so that logits match in fp32:
RMSNorm normalises in fp32 and multiplies the weight in the input dtype; RoPE builds cos/sin in
fp32 (scaled by the YaRN attention factor) and rotates halves of each head.

RoPE frequency variants: default, linear (positions / factor), llama3 (Llama 3.1 wavelength bands),
yarn (YaRN, Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large Language Models",
with DeepSeek's mscale / mscale_all_dim attention factor).

Under `rollout.match_training` on CUDA (`exact.is_exact()` and `exact.uses_kernels`) RMSNorm,
SwiGLU's silu(gate) * up and `apply_rope` run as the fused batch-invariant kernels of
`exact_fused.py` in both engines (one launch each way where the eager formula is several); elsewhere,
and in default mode, the torch formulas below run as they are.

Shape legend: N tokens (any leading token dims), H heads, D channels.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from rlloom.models.args import RopeArgs
from rlloom.models.exact import is_exact, uses_kernels


def _fused(x: torch.Tensor) -> bool:
    """Whether x's op runs as an `exact_fused` kernel (exact numerics on CUDA)."""
    return is_exact() and uses_kernels(x)


def _exact_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`exact_fused.rms_norm` on the local rows when training's tensor parallelism hands the norm
    DTensors (tokens or heads sharded, the weight replicated; parallel/tp.py): a row is whole on its
    rank, so the kernel runs on the local shard as the rollout runs it on its rows. The weight's
    gradient is then this rank's partial sum (Partial), unless x is replicated everywhere (a plain x
    beside a DTensor weight is a rank's own rows)."""
    from rlloom.models import exact_fused  # Triton: imported where it runs

    sharded = not isinstance(x, DTensor) or not all(p.is_replicate() for p in x.placements)
    w = weight
    if isinstance(weight, DTensor):
        w = weight.to_local(grad_placements=[Partial() if sharded else Replicate()] * weight.device_mesh.ndim)
    if not isinstance(x, DTensor):
        return exact_fused.rms_norm(x, w, eps)
    out = exact_fused.rms_norm(x.to_local(), w, eps)
    return DTensor.from_local(out, x.device_mesh, x.placements, run_check=False)


class RMSNorm(nn.Module):
    """Root-mean-square norm: x / rms(x) * weight, normalised in fp32."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _fused(x):
            return _exact_rms_norm(x, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class FusedLinear(nn.Linear):
    """Several projections of the same input as one matmul: their weight (and bias) rows stacked in
    the order of `parts` (name -> output width). Checkpoints and weight sync still see the separate
    projections: `rlloom.models.adapter` maps `<parent>.<part>.weight` to rows of this weight.

    Rollout models use it (`ModelArgs.fused_projections`): at decode batch sizes one wide matmul
    runs faster than three narrow ones. Training keeps the projections separate so that sharding
    plans and FSDP see one tensor per checkpoint tensor."""

    def __init__(self, dim: int, parts: dict[str, int], bias: bool) -> None:
        super().__init__(dim, sum(parts.values()), bias=bias)
        self.parts = dict(parts)

    def forward_parts(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [.., dim] -> one [.., width] tensor per part."""
        return self(x).split(list(self.parts.values()), dim=-1)


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x): gate (w1), down (w2) and up (w3) projections without bias; with
    `fused` the gate and up projections are one `FusedLinear` (w13)."""

    def __init__(self, dim: int, hidden: int, *, fused: bool = False) -> None:
        super().__init__()
        self.fused = fused
        if fused:
            self.w13 = FusedLinear(dim, {"w1": hidden, "w3": hidden}, bias=False)
            self.w2 = nn.Linear(hidden, dim, bias=False)
        else:
            self.w1 = nn.Linear(dim, hidden, bias=False)
            self.w2 = nn.Linear(hidden, dim, bias=False)
            self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13.forward_parts(x) if self.fused else (self.w1(x), self.w3(x))
        return self.w2(silu_mul(gate, up))


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's F.silu(gate) * up (the dense MLP's and the routed experts')."""
    if _fused(gate):
        from rlloom.models import exact_fused

        return exact_fused.silu_mul(gate, up)
    return F.silu(gate) * up


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN magnitude correction 0.1 * mscale * ln(scale) + 1 (1 when not extending)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _llama3_inv_freq(inv_freq: torch.Tensor, r: RopeArgs) -> torch.Tensor:
    old_ctx = r.original_max_position_embeddings
    low_wavelen, high_wavelen = old_ctx / r.low_freq_factor, old_ctx / r.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / r.factor, inv_freq)
    smooth = (old_ctx / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor)
    smoothed = (1 - smooth) * scaled / r.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(r: RopeArgs) -> tuple[torch.Tensor, float]:
    dim, base = r.dim, r.theta

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(r.original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low, high = correction_dim(r.beta_fast), correction_dim(r.beta_slow)
    if r.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    inv_extra, inv_inter = 1.0 / pos_freqs, 1.0 / (r.factor * pos_freqs)
    inv_freq = inv_inter * (1 - extrapolation_weight) + inv_extra * extrapolation_weight
    if r.attention_factor is not None:
        attention_factor = float(r.attention_factor)
    elif r.mscale and r.mscale_all_dim:
        attention_factor = yarn_mscale(r.factor, r.mscale) / yarn_mscale(r.factor, r.mscale_all_dim)
    else:
        attention_factor = yarn_mscale(r.factor)
    return inv_freq, attention_factor


def rope_inv_freq(r: RopeArgs) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim/2] fp32, attention_factor multiplying cos and sin)."""
    if r.rope_type == "yarn":
        return _yarn_inv_freq(r)
    inv_freq = 1.0 / (r.theta ** (torch.arange(0, r.dim, 2, dtype=torch.int64).float() / r.dim))
    if r.rope_type == "linear":
        inv_freq = inv_freq / r.factor
    elif r.rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, r)
    return inv_freq, 1.0


class RotaryEmbedding(nn.Module):
    """Turns position ids into (cos, sin) [..., T, dim] in the compute dtype."""

    def __init__(self, args: RopeArgs) -> None:
        super().__init__()
        self.args = args
        inv_freq, self.attention_factor = rope_inv_freq(args)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def init_buffers(self) -> None:
        """Recompute inv_freq in fp32 on its device (it holds garbage after `to_empty`)."""
        if self.inv_freq.device.type != "meta":
            self.inv_freq = rope_inv_freq(self.args)[0].to(self.inv_freq.device)

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001, ANN202
        # `model.to(bf16)` would round the frequencies and `to_empty` would leave them garbage:
        # recompute them in fp32 after every device or dtype move.
        super()._apply(fn, recurse)
        self.init_buffers()
        return self

    def forward(
        self, position_ids: torch.Tensor, dtype: torch.dtype, *, axes3: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [..., dim] of position_ids [...]; with `axes3` (M-RoPE) position_ids is [3, ...]
        (temporal, height, width) and each `mrope_section` of frequency pairs reads its axis."""
        freqs = position_ids.float().unsqueeze(-1) * self.inv_freq.float()
        if axes3:
            assert self.args.mrope_section is not None, "3-D positions need mrope_section"
            if self.args.mrope_interleaved:
                axis = mrope_pair_axes(self.args.mrope_section, freqs.shape[-1]).to(freqs.device)
                freqs = torch.where(axis == 1, freqs[1], torch.where(axis == 2, freqs[2], freqs[0]))
            else:
                parts = freqs.split(list(self.args.mrope_section), dim=-1)
                freqs = torch.cat([part[i % 3] for i, part in enumerate(parts)], dim=-1)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.attention_factor, emb.sin() * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def mrope_pair_axes(section: tuple[int, ...], num_pairs: int) -> torch.Tensor:
    """[num_pairs] the position axis (0 temporal, 1 height, 2 width) each frequency pair reads under
    interleaved M-RoPE (transformers' Qwen3-VL `recomposition_frequencies`)."""
    j = torch.arange(num_pairs)
    height = (j % 3 == 1) & (j < 3 * section[1])
    width = (j % 3 == 2) & (j < 3 * section[2])
    return torch.where(height, 1, torch.where(width, 2, 0))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = False
) -> torch.Tensor:
    """Rotate x [..., T, H, D] by cos/sin [..., T, D]; interleaved pairs are first de-interleaved."""
    if _fused(x):
        from rlloom.models import exact_fused

        return exact_fused.rope(x, cos, sin, interleaved)
    if interleaved:
        x = x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return x * cos + _rotate_half(x) * sin
