"""Images in the rollout engine (Qwen2.5-VL): a prompt's image features, computed once when the
request arrives and shared by its n samples, and the 3-D positions of its tokens.

A prefill of tokens start..end of a sequence takes the feature rows of the prompt's image tokens in
that range (a re-prefill after preemption, or one that resumes after a weight update, covers any
part of the prompt) and M-RoPE positions: the prompt's own (`mrope.mrope_positions`), and for
generated tokens their index + delta on all three axes. Decode steps need only that shift, so they
run with one position per token (`rope_positions`).

A generated token that happens to be the image placeholder stays a text token (only the prompt's
placeholders get features), as in transformers' generate.

Prefix caching (block_manager.py) keys a block on its tokens and on the pictures whose placeholders
it holds (`VisionPrompt.pictures_in`): the placeholder ids are the same for every picture of one
size, so token ids alone would serve one picture's keys and values to a prompt with another. A
picture is known by a digest of its pixel values and patch grid (`picture_digest`). M-RoPE
positions need nothing more: a prompt's positions up to a token depend only on the tokens and the
pictures' grids before it, so a cached block holds the keys and values its new holder would compute.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from rlloom.data.images import ImageInputs
from rlloom.models.model import CausalLM
from rlloom.models.mrope import decode_delta, mrope_positions
from rlloom.models.vision import grid_list, merged_tokens


@dataclass(frozen=True, slots=True)
class VisionPrompt:
    """What the engine keeps of one prompt's images (one object for the request's n sequences)."""

    embeds_MD: torch.Tensor
    """[M, D] the tower's features of the prompt's M image tokens, in order, on the model's device
    (Qwen3-VL: [M, 1 + K, D], each token's DeepStack rows with it, so a slice of tokens takes both)."""
    positions_3T: torch.Tensor
    """[3, T] long M-RoPE positions of the prompt's T tokens (host)."""
    image_token_id: int
    pictures: tuple[tuple[int, int, int], ...]
    """(first token, end token, `picture_digest`) of each image's run of placeholders in the prompt
    (empty without prefix caching: `encode_images`)."""

    @property
    def delta(self) -> int:
        """Generated token j (sequence index) sits at position j + delta."""
        return decode_delta(self.positions_3T)

    def pictures_in(self, start: int, end: int) -> tuple[int, ...]:
        """The digests of the pictures with placeholders among tokens start..end (a cache block)."""
        return tuple(digest for first, last, digest in self.pictures if first < end and last > start)


def picture_digest(pixels: torch.Tensor, grid: tuple[int, int, int]) -> int:
    """A picture's identity for prefix caching: a 64-bit digest of its patch grid and pixel values."""
    digest = hashlib.blake2b(repr(grid).encode(), digest_size=8)
    digest.update(pixels.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())
    return int.from_bytes(digest.digest(), "little")


def picture_runs(
    prompt_ids: list[int], images: ImageInputs, image_token_id: int, merge: int
) -> tuple[tuple[int, int, int], ...]:
    """`VisionPrompt.pictures` of a prompt whose placeholder runs fit its images (mrope_positions
    checked that): image k's run is the first `merged_tokens` placeholders from where k - 1's ended."""
    grid = grid_list(images.grid_thw)
    out, start, row = [], 0, 0
    for thw, size in zip(grid, merged_tokens(grid, merge)):
        start = prompt_ids.index(image_token_id, start)
        patches = thw[0] * thw[1] * thw[2]
        out.append((start, start + size, picture_digest(images.pixel_values[row : row + patches], thw)))
        start, row = start + size, row + patches
    return tuple(out)


@torch.no_grad()
def encode_images(
    model: CausalLM, prompt_ids: list[int], images: ImageInputs, *, key_pictures: bool
) -> VisionPrompt:
    """Run the vision tower once for a prompt (ValueError when the images do not fit the prompt);
    `key_pictures` (prefix caching) also digests each picture, else `VisionPrompt.pictures` is empty
    (reading every pixel costs milliseconds a picture)."""
    vision = model.args.vision
    assert vision is not None and model.visual is not None, "images reach only vision-language models"
    positions = mrope_positions(prompt_ids, images.grid_thw.tolist(), vision)
    param = next(model.visual.parameters())
    embeds = model.visual(images.pixel_values.to(param.device, param.dtype), images.grid_thw)
    pictures = (
        picture_runs(prompt_ids, images, vision.image_token_id, vision.spatial_merge_size)
        if key_pictures
        else ()
    )
    return VisionPrompt(
        embeds_MD=embeds, positions_3T=positions, image_token_id=vision.image_token_id, pictures=pictures
    )


def request_vision(
    model: CausalLM, prompt_ids: list[int], images: ImageInputs | None, *, key_pictures: bool
) -> tuple[VisionPrompt | None, str | None]:
    """(a request's encoded images or None, why its images cannot be used or None); `key_pictures`
    as in `encode_images`."""
    if images is None:
        return None, None
    if model.args.vision is None:
        return None, f"the request has images but the {model.args.model_type} model has no vision tower"
    try:
        return encode_images(model, prompt_ids, images, key_pictures=key_pictures), None
    except ValueError as err:
        return None, str(err)


def prefill_rows(
    prompt_ids: list[int], vision: VisionPrompt | None, start: int, end: int
) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
    """For tokens start..end of a sequence whose prompt is `prompt_ids`: ([3, end - start] positions,
    [k, D] feature rows of its image tokens or None, their offsets within start..end)."""
    num_prompt = len(prompt_ids)
    tail = torch.arange(max(start, num_prompt), end)
    if vision is None:
        return torch.arange(start, end).expand(3, -1), None, []
    head = vision.positions_3T[:, start : min(end, num_prompt)]
    positions = torch.cat([head, (tail + vision.delta).expand(3, -1)], dim=1)
    first = sum(1 for t in prompt_ids[:start] if t == vision.image_token_id)
    offsets = [
        i - start for i in range(start, min(end, num_prompt)) if prompt_ids[i] == vision.image_token_id
    ]
    return positions, vision.embeds_MD[first : first + len(offsets)], offsets
