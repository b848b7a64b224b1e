"""Images of a prompt: the files a dataset row names (checked with Pillow when the file is read)
and the record the rollout engine and the model take, `ImageInputs`.

A row names its pictures in its chat messages, as transformers' chat templates take them
(`{"role": "user", "content": [{"type": "image", "image": "cats/1.png"}, {"type": "text", "text":
"How many cats?"}]}`), or in an `images` column of paths; relative paths are relative to the data
file's folder. A missing file stops the start-up (a wrong folder usually misses them all); a file
Pillow cannot read, or an oversized picture, makes its row a bad row, skipped and counted.

Pixels are what transformers' image processor writes for Qwen2.5-VL (`Qwen2VLImageProcessor`):
`pixel_values` [P, C*T*ps*ps] rows of patches and `image_grid_thw` [I, 3] the patch grid of each
image; the prompt holds one run of image placeholder tokens per image, in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


@dataclass(frozen=True, slots=True)
class ImageProcessing:
    """How a vision-language model reads a prompt's pictures: transformers' image processor of its
    folder, the placeholder token its chat template writes once per image, and how many patches
    (merge x merge) make one language-model token.

    Example: `ImageProcessing(processor=AutoImageProcessor.from_pretrained(path), image_token_id=151655,
    merge=2)`.
    """

    processor: Any
    image_token_id: int
    merge: int

    def prompt(self, ids: list[int], paths: tuple[str, ...]) -> tuple[list[int], ImageInputs]:
        """(the prompt ids with each placeholder expanded to its image's token run, the pixels)."""
        images = read_images(paths, self.processor)
        return expand_image_tokens(ids, self.image_token_id, images, self.merge), images


MAX_IMAGE_PIXELS = 64 * 2**20
"""A picture with more pixels is skipped as oversized: decoding it costs gigabytes of host memory,
and the image processor shrinks it to its own max_pixels anyway (Pillow refuses 89M as a
decompression bomb)."""


def row_image_refs(row: dict, prompt: object) -> list[str] | str:
    """The image files a row names, in prompt order: its chat messages' `{"type": "image", "image":
    path}` parts, or its `images` column (a list of paths); or the reason the row is unusable."""
    parts = [
        part
        for message in (prompt if isinstance(prompt, list) else [])
        if isinstance(message, dict) and isinstance(message.get("content"), list)
        for part in message["content"]
        if isinstance(part, dict) and part.get("type") == "image"
    ]
    column = row.get("images")
    if parts and column:
        return "the row has both image parts in its messages and an images column; keep one"
    if column is not None:
        if not (isinstance(column, list) and all(isinstance(p, str) and p for p in column)):
            return "images must be a list of file paths"
        return list(column)
    refs = [part.get("image") for part in parts]
    if not all(isinstance(p, str) and p for p in refs):
        return 'an image part needs "image": a file path'
    return refs  # type: ignore[return-value]


def image_problem(path: Path) -> str:
    """Why the picture at `path` (an existing file) cannot be used ('' when it can): Pillow cannot
    read it, or it is oversized (`MAX_IMAGE_PIXELS`). Only the header is decoded, then verified."""
    from PIL import Image

    try:
        with Image.open(path) as picture:
            width, height = picture.size
            if width * height > MAX_IMAGE_PIXELS:
                return f"image {path.name} is oversized ({width} x {height} > {MAX_IMAGE_PIXELS} pixels)"
            picture.verify()
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        return f"image {path.name} does not read ({type(e).__name__}: {' '.join(str(e).split())[:80]})"
    return ""


def read_images(paths: tuple[str, ...], processor: Any) -> ImageInputs:
    """A prompt's picture files through transformers' image processor (the model folder's
    `preprocessor_config.json`, `AutoImageProcessor`), as RGB."""
    from PIL import Image

    pictures = []
    for path in paths:
        with Image.open(path) as picture:
            pictures.append(picture.convert("RGB"))
    out = processor(images=pictures, return_tensors="pt")
    return ImageInputs(pixel_values=out["pixel_values"], grid_thw=out["image_grid_thw"].to(torch.long))


def expand_image_tokens(ids: list[int], image_token_id: int, images: ImageInputs, merge: int) -> list[int]:
    """`ids` with its k-th image placeholder token repeated once per merged patch of image k (the
    chat template writes one placeholder per image; the model replaces each copy with one feature
    row), as transformers' Qwen2.5-VL processor expands `<|image_pad|>`. ValueError when the
    placeholders and the images do not pair up."""
    sizes = [t * h * w // merge**2 for t, h, w in images.grid_thw.tolist()]
    if ids.count(image_token_id) != len(sizes):
        raise ValueError(
            f"the prompt holds {ids.count(image_token_id)} image placeholders for {len(sizes)} image(s)"
        )
    out: list[int] = []
    k = 0
    for token in ids:
        if token == image_token_id:
            out.extend([token] * sizes[k])
            k += 1
        else:
            out.append(token)
    return out
