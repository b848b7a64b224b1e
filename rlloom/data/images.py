"""Images of a prompt: the record the rollout engine and the model take, `ImageInputs`.

Pixels are what transformers' image processor writes for Qwen2.5-VL (`Qwen2VLImageProcessor`):
`pixel_values` [P, C*T*ps*ps] rows of patches and `image_grid_thw` [I, 3] the patch grid of each
image; the prompt holds one run of image placeholder tokens per image, in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class ImageInputs:
    """The images of one prompt, processed.

    Example: two 56 x 56 pictures -> `ImageInputs(pixel_values=<[32, 1176]>,
    grid_thw=tensor([[1, 4, 4], [1, 4, 4]]))` (4 merged tokens each at spatial_merge_size 2).
    """

    pixel_values: torch.Tensor
    """[P, C*T*ps*ps] patches of every image, image after image."""
    grid_thw: torch.Tensor
    """[I, 3] long: each image's (frames, patch rows, patch columns)."""
