"""Qwen2.5-VL's vision tower: image patches -> features that replace the prompt's image tokens.

Pixels arrive as transformers' image processor writes them (`Qwen2VLImageProcessor`: each image a
grid of t x h x w patches of `in_channels x temporal_patch_size x patch_size x patch_size` values,
ordered so that every `spatial_merge_size`^2 square of patches is consecutive). The tower embeds the
patches (a Conv3d), runs pre-norm blocks with 2-D rotary positions (height and width, each on half
of a head's frequencies), attends inside windows of `window_size` pixels except in
`fullatt_block_indexes` (whole image), and merges each square of patches into one token of the
language model's width (RMSNorm, then Linear-GELU-Linear over the concatenated square).

Windows follow transformers' reference: the merged-patch squares are reordered window by window
(`window_plan`), the blocks run on that order, and the merged features are put back in raster
order. Module and parameter names are the Hugging Face ones, so the checkpoint's `visual.*` tensors
load by name.

Shape legend: P patches, M merged tokens (P / merge^2), I images, H heads, D head_dim, E width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rlloom.models.arg_parts import VisionArgs
from rlloom.models.layers import RMSNorm, _rotate_half

Grid = list[tuple[int, int, int]]
"""Per image (t, h, w): its patch grid (processor's `image_grid_thw`)."""


def grid_list(grid_thw: torch.Tensor | Grid) -> Grid:
    """`image_grid_thw` [I, 3] as a host list of (t, h, w)."""
    rows = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else grid_thw
    return [(int(t), int(h), int(w)) for t, h, w in rows]


def merged_tokens(grid: Grid, merge: int) -> list[int]:
    """Language-model tokens (merged patch squares) of each image."""
    return [t * (h // merge) * (w // merge) for t, h, w in grid]


def patch_positions(grid: Grid, merge: int) -> torch.Tensor:
    """[P, 2] (row, column) of every patch, in the processor's order (merge squares consecutive)."""
    out = []
    for t, h, w in grid:
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        block = (h // merge, merge, w // merge, merge)
        rows, cols = (
            rows.reshape(block).transpose(1, 2).flatten(),
            cols.reshape(block).transpose(1, 2).flatten(),
        )
        out.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
    return torch.cat(out)


def window_plan(grid: Grid, args: VisionArgs) -> tuple[torch.Tensor, list[int]]:
    """(window_index [M]: merged squares in window order, cu_windows: patch offsets of the non-empty
    windows in that order), as transformers' `get_vision_window_index`."""
    merge = args.spatial_merge_size
    side = args.window_size // merge // args.patch_size  # window side in merged squares
    index, cu, offset = [], [0], 0
    for t, h, w in grid:
        gh, gw = h // merge, w // merge
        ids = torch.arange(t * gh * gw).reshape(t, gh, gw)
        pad_h, pad_w = side - gh % side, side - gw % side
        padded = F.pad(ids, (0, pad_w, 0, pad_h), value=-1)
        nh, nw = (gh + pad_h) // side, (gw + pad_w) // side
        padded = padded.reshape(t, nh, side, nw, side).permute(0, 1, 3, 2, 4).reshape(t, nh * nw, side * side)
        sizes = (padded >= 0).sum(-1).flatten()
        flat = padded.flatten()
        index.append(flat[flat >= 0] + offset)
        for size in sizes.tolist():
            if size:
                cu.append(cu[-1] + size * merge * merge)
        offset += t * gh * gw
    return torch.cat(index), cu


def image_offsets(grid: Grid) -> list[int]:
    """Patch offsets of every frame (full attention is per frame of each image)."""
    cu = [0]
    for t, h, w in grid:
        cu.extend(cu[-1] + h * w * (i + 1) for i in range(t))
    return cu


def segment_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int], scale: float
) -> torch.Tensor:
    """Bidirectional attention inside each segment cu[i]:cu[i+1]; q/k/v [P, H, D] -> [P, H, D]. The
    segments are padded into one batch (a key mask hides the padding) so one SDPA call runs them."""
    lens = torch.tensor([b - a for a, b in zip(cu, cu[1:])], device=q.device)
    starts = torch.tensor(cu[:-1], device=q.device)
    seg = torch.repeat_interleave(torch.arange(len(lens), device=q.device), lens)
    pos = torch.arange(q.shape[0], device=q.device) - starts[seg]
    longest = int(max(b - a for a, b in zip(cu, cu[1:])))

    def batch(x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(len(lens), longest, *x.shape[1:])
        out[seg, pos] = x
        return out.transpose(1, 2)  # [S, H, L, D]

    keep = (torch.arange(longest, device=q.device)[None, :] < lens[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(batch(q), batch(k), batch(v), attn_mask=keep, scale=scale)
    return out.transpose(1, 2)[seg, pos]


class PatchEmbed(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.shape = (args.in_channels, args.temporal_patch_size, args.patch_size, args.patch_size)
        self.proj = nn.Conv3d(
            args.in_channels, args.hidden_size, kernel_size=self.shape[1:], stride=self.shape[1:], bias=False
        )

    def forward(self, pixels_PC: torch.Tensor) -> torch.Tensor:
        x = pixels_PC.view(-1, *self.shape).to(self.proj.weight.dtype)
        return self.proj(x).flatten(1)


class VisionAttention(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.num_heads = args.num_heads
        self.qkv = nn.Linear(args.hidden_size, 3 * args.hidden_size)
        self.proj = nn.Linear(args.hidden_size, args.hidden_size)
        self.scale = (args.hidden_size // args.num_heads) ** -0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu: list[int]) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, self.num_heads, -1)).unbind(1)
        # Rotated in fp32, as the reference does.
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(x.dtype)
        return self.proj(segment_attention(q, k, v, cu, self.scale).flatten(-2))


class VisionMLP(nn.Module):
    """SwiGLU with biases (the Hugging Face names gate/up/down_proj)."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.norm1 = RMSNorm(args.hidden_size, 1e-6)
        self.norm2 = RMSNorm(args.hidden_size, 1e-6)
        self.attn = VisionAttention(args)
        self.mlp = VisionMLP(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, cu)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.width = args.hidden_size * args.spatial_merge_size**2
        self.ln_q = RMSNorm(args.hidden_size, 1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, args.out_hidden_size)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class VisionTower(nn.Module):
    """Patches [P, C*T*ps*ps] and their grids -> merged features [M, out_hidden_size] in prompt order."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.args = args
        self.patch_embed = PatchEmbed(args)
        self.blocks = nn.ModuleList(VisionBlock(args) for _ in range(args.depth))
        self.merger = PatchMerger(args)
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self) -> torch.Tensor:
        """[head_dim / 4] fp32: each of height and width rotates half of a head's channels."""
        dim = self.args.hidden_size // self.args.num_heads // 2
        return 1.0 / (self.args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))

    def init_buffers(self) -> None:
        """Recompute inv_freq in fp32 on its device (garbage after `to_empty`, rounded by `.to(bf16)`)."""
        if self.inv_freq.device.type != "meta":
            self.inv_freq = self._inv_freq().to(self.inv_freq.device)

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001, ANN202
        super()._apply(fn, recurse)
        self.init_buffers()
        return self

    def _rotary(self, grid: Grid, order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [P, D] fp32 of the patches in window order."""
        freqs = patch_positions(grid, self.args.spatial_merge_size).to(self.inv_freq.device)
        freqs = (freqs[..., None].float() * self.inv_freq).flatten(1)  # [P, D/2]: rows then columns
        freqs = torch.cat([freqs, freqs], dim=-1)[order]
        return freqs.cos(), freqs.sin()

    def forward(self, pixels_PC: torch.Tensor, grid_thw: torch.Tensor | Grid) -> torch.Tensor:
        grid = grid_list(grid_thw)
        unit = self.args.spatial_merge_size**2
        window_index, cu_windows = window_plan(grid, self.args)
        window_index = window_index.to(pixels_PC.device)
        # Patch order inside the tower: merged squares window by window, each square's patches together.
        order = (window_index[:, None] * unit + torch.arange(unit, device=pixels_PC.device)).flatten()
        x = self.patch_embed(pixels_PC)[order]
        cos, sin = self._rotary(grid, order)
        cu_images = image_offsets(grid)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, cu_images if i in self.args.fullatt_block_indexes else cu_windows)
        return self.merger(x)[torch.argsort(window_index)]
