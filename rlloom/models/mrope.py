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

from rlloom.data.types import StreamImages
from rlloom.models.arg_parts import VisionArgs
from rlloom.models.vision import Grid, grid_list, merged_tokens


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


def stream_positions(
    input_ids_N: torch.Tensor, position_ids_N: torch.Tensor, images: StreamImages, args: VisionArgs
) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed stream's M-RoPE positions [3, N] and the stream rows of its image tokens [M] (host
    tensors), as the rollout computes them per document: a segment with pictures takes its prompt's
    `mrope_positions`, and a token at text position q >= the prompt length (a response token, in
    either packed layout) sits at q + delta on all three axes; other segments keep their text
    positions on all three. Only prompt placeholders are image tokens: a generated placeholder id
    stays text, as in the rollout."""
    positions_3N = position_ids_N.expand(3, -1).clone()
    rows = []
    grid = grid_list(images.grid_thw)
    for seg in images.segments:
        prompt = input_ids_N[seg.start : seg.start + seg.prompt_len].tolist()
        head_3P = mrope_positions(prompt, grid[seg.first_image : seg.first_image + seg.num_images], args)
        text_S = position_ids_N[seg.start : seg.end]
        tail = torch.arange(seg.prompt_len, int(text_S.max()) + 1) + decode_delta(head_3P)
        table_3Q = torch.cat([head_3P, tail.expand(3, -1)], dim=1)
        positions_3N[:, seg.start : seg.end] = table_3Q[:, text_S]
        is_image = torch.tensor(prompt) == args.image_token_id
        rows.append(is_image.nonzero().squeeze(1) + seg.start)
    return positions_3N, torch.cat(rows)
