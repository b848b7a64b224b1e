"""M-RoPE positions (Qwen2.5-VL; Qwen3-VL's images get the same): three position ids per token,
temporal, height and width.

Text tokens carry one position on all three axes, counting on from the previous token as in a text
model. An image's merged tokens (t x h x w squares) carry (start + frame, start + row, start +
column), and the text after the image continues from start + max(h, w): an image advances the
position by its longer side, not by its token count. So a document's positions end at
`max + 1 = T + delta`, and a token generated at sequence index j >= T sits at j + delta on all three
axes (`decode_delta`).

The rotary side (which frequency pairs each axis drives) lives in `layers.RotaryEmbedding`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlloom.models.arg_parts import VisionArgs
from rlloom.models.vision import Grid, merged_tokens


def mrope_positions(input_ids: Sequence[int], grid: Grid, args: VisionArgs) -> torch.Tensor:
    """[3, T] long positions of one document whose image tokens belong, in order, to `grid`'s images
    (transformers' `get_rope_index` for one unpadded sequence of images)."""
    merge = args.spatial_merge_size
    sizes = merged_tokens(grid, merge)
    parts, pos, i, image = [], 0, 0, 0
    ids = list(input_ids)
    while i < len(ids):
        if ids[i] != args.image_token_id:
            j = i
            while j < len(ids) and ids[j] != args.image_token_id:
                j += 1
            parts.append(torch.arange(pos, pos + j - i).expand(3, -1))
            pos, i = pos + j - i, j
            continue
        if image >= len(grid):
            raise ValueError(
                f"the prompt has more image tokens than its {len(grid)} image(s) fill "
                f"(image_token_id {args.image_token_id}). Fix: one placeholder run per image, as the processor writes."
            )
        t, h, w = grid[image]
        frames, rows, cols = torch.meshgrid(
            torch.arange(t), torch.arange(h // merge), torch.arange(w // merge), indexing="ij"
        )
        parts.append(torch.stack([frames, rows, cols]).reshape(3, -1) + pos)
        pos += max(h, w) // merge
        i += sizes[image]
        image += 1
    if image != len(grid) or i != len(ids):
        raise ValueError(
            f"the prompt's image tokens fill {image} of its {len(grid)} image(s) (token count {i} vs "
            f"{len(ids)}). Fix: build the prompt with the processor, which writes one run per image."
        )
    return torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.long)


def decode_delta(positions_3T: torch.Tensor) -> int:
    """What a generated token's position adds to its sequence index: max + 1 - T (0 without images)."""
    return int(positions_3T.max()) + 1 - positions_3T.shape[1] if positions_3T.numel() else 0
