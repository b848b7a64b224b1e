"""Qwen3-VL's vision tower: image patches -> the features of the prompt's image tokens and DeepStack's.

What differs from Qwen2.5-VL's tower (`vision.py`, whose patch order, 2-D rotary positions and
attention it shares): no windows (every block attends over a whole frame), a learned square table of
patch positions resampled bilinearly (corners aligned) to each image's grid and added to the patch
embeddings, LayerNorm blocks with a GELU (tanh) MLP, a LayerNorm patch merger, and DeepStack: after
each block of `deepstack_visual_indexes` a merger of its own (normed over the concatenated square,
"postshuffle") turns the patches into one more row per image token. The model adds row k + 1 to the
hidden states of the image tokens after decoder layer k (`model.py`).

Output: [M, D] without DeepStack, else [M, 1 + K, D] (the merged features, then the K DeepStack rows),
so that a slice of image tokens (the rollout's prefill of part of a prompt) slices every row alike.
Module and parameter names are the Hugging Face ones (under `model.visual.` in the checkpoint).

Shape legend: P patches, M merged tokens, K DeepStack rows, E tower width, D language-model width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rlloom.models.arg_parts import VisionArgs
from rlloom.models.vision import (
    Grid,
    PatchEmbed,
    VisionAttention,
    VisionTower,
    grid_list,
    image_offsets,
    patch_positions,
)


def bilinear_taps(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([P, 2] rows of a `side`-long table, [P, 2] fp32 weights) that resample the table to `size`
    positions with corners aligned (`F.interpolate(mode="bilinear", align_corners=True)` per axis)."""
    src = index.float() * (side - 1) / torch.clamp(size - 1, min=1).float()
    floor = torch.floor(src)
    offsets = torch.arange(2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def position_taps(grid: Grid, merge: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([P, 4] rows of the flattened side x side table, [P, 4] fp32 weights) of every patch, in the
    processor's patch order (transformers' `get_vision_interpolation_indices_and_weights`)."""
    rows_cols = patch_positions(grid, merge)
    sizes = torch.cat([torch.tensor([[h, w]]).expand(t * h * w, 2) for t, h, w in grid])
    h_taps, h_weights = bilinear_taps(rows_cols[:, 0], sizes[:, 0], side)
    w_taps, w_weights = bilinear_taps(rows_cols[:, 1], sizes[:, 1], side)
    taps = (h_taps[:, :, None] * side + w_taps[:, None, :]).flatten(1)
    return taps, (h_weights[:, :, None] * w_weights[:, None, :]).flatten(1)


class Qwen3PatchEmbed(PatchEmbed):
    """Qwen2.5-VL's patch Conv3d with a bias."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__(args)
        kernel = self.shape[1:]
        self.proj = nn.Conv3d(
            args.in_channels, args.hidden_size, kernel_size=kernel, stride=kernel, bias=True
        )


class Qwen3VisionMLP(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(args.hidden_size, args.intermediate_size)
        self.linear_fc2 = nn.Linear(args.intermediate_size, args.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class Qwen3VisionBlock(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(args.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(args.hidden_size, eps=1e-6)
        self.attn = VisionAttention(args)
        self.mlp = Qwen3VisionMLP(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, cu)
        return x + self.mlp(self.norm2(x))


class Qwen3PatchMerger(nn.Module):
    """LayerNorm (over each patch, or with `postshuffle` over the concatenated square), then
    Linear-GELU-Linear from the square's width to the language model's."""

    def __init__(self, args: VisionArgs, *, postshuffle: bool) -> None:
        super().__init__()
        self.width = args.hidden_size * args.spatial_merge_size**2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.width if postshuffle else args.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, args.out_hidden_size)

    def forward(self, x_PE: torch.Tensor) -> torch.Tensor:
        x = self.norm(x_PE.view(-1, self.width)) if self.postshuffle else self.norm(x_PE).view(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3VisionTower(VisionTower):
    """Patches [P, C*T*ps*ps] and their grids -> [M, D] or [M, 1 + K, D] (module docstring). The
    rotary table and its fp32 buffer are Qwen2.5-VL's (`VisionTower`); the modules are its own."""

    def __init__(self, args: VisionArgs) -> None:
        nn.Module.__init__(self)
        assert args.num_position_embeddings is not None, "Qwen3-VL's tower has a learned position table"
        self.args = args
        self.side = int(args.num_position_embeddings**0.5)
        self.patch_embed = Qwen3PatchEmbed(args)
        self.pos_embed = nn.Embedding(args.num_position_embeddings, args.hidden_size)
        self.blocks = nn.ModuleList(Qwen3VisionBlock(args) for _ in range(args.depth))
        self.merger = Qwen3PatchMerger(args, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(
            Qwen3PatchMerger(args, postshuffle=True) for _ in args.deepstack_visual_indexes
        )
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def forward(self, pixels_PC: torch.Tensor, grid_thw: torch.Tensor | Grid) -> torch.Tensor:
        grid = grid_list(grid_thw)
        device = pixels_PC.device
        x = self.patch_embed(pixels_PC)
        taps, weights = position_taps(grid, self.args.spatial_merge_size, self.side)
        # Weighted in fp32 (the weights' dtype), as the reference does, then cast to the tower's dtype.
        positions = (self.pos_embed(taps.to(device)) * weights.to(device)[:, :, None]).sum(1)
        x = x + positions.to(x.dtype)
        cos, sin = self._rotary(grid, torch.arange(x.shape[0], device=device))
        cu = image_offsets(grid)
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, cu)
            if i in self.args.deepstack_visual_indexes:
                merger = self.deepstack_merger_list[self.args.deepstack_visual_indexes.index(i)]
                deepstack.append(merger(x))
        merged = self.merger(x)
        return torch.stack([merged, *deepstack], dim=1) if deepstack else merged
