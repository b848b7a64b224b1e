"""A tiny random Qwen2.5-VL for the vision-language tests: the transformers model (lively weights),
pictures through transformers' own image processor, and prompts with one placeholder run per image."""

from __future__ import annotations

import numpy as np
import torch
from models_testutil import randomize_
from PIL import Image
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

VOCAB, IMAGE, START, END = 300, 290, 288, 289


def tiny_vl_config() -> Qwen2_5_VLConfig:
    text = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        bos_token_id=None,
        eos_token_id=VOCAB - 1,
    )
    vision = dict(
        depth=3,
        hidden_size=32,
        intermediate_size=48,
        num_heads=2,
        out_hidden_size=64,
        window_size=56,  # 2 x 2 merged squares per window
        fullatt_block_indexes=[1],
    )
    return Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE,
        video_token_id=291,
        vision_start_token_id=START,
        vision_end_token_id=END,
    )


def tiny_vl(seed: int = 0) -> Qwen2_5_VLForConditionalGeneration:
    torch.manual_seed(seed)
    return randomize_(Qwen2_5_VLForConditionalGeneration(tiny_vl_config()), seed).eval()


def processed_images(*sizes: tuple[int, int], seed: int = 0) -> dict[str, torch.Tensor]:
    """transformers' processor output (pixel_values, image_grid_thw) of random pictures of (w, h)."""
    gen = np.random.default_rng(seed)
    pics = [Image.fromarray(gen.integers(0, 255, (h, w, 3), dtype=np.uint8)) for w, h in sizes]
    processor = Qwen2VLImageProcessorPil(size={"shortest_edge": 28 * 28, "longest_edge": 200 * 200})
    return dict(processor(images=pics, return_tensors="pt"))


def vl_prompt(grid: torch.Tensor, seed: int) -> torch.Tensor:
    """Text, then each image as <start> image tokens <end> with text between, then text."""
    gen = torch.Generator().manual_seed(seed)
    parts = [torch.randint(0, 280, (5,), generator=gen)]
    for t, h, w in grid.tolist():
        parts += [torch.tensor([START]), torch.full((t * h * w // 4,), IMAGE), torch.tensor([END])]
        parts.append(torch.randint(0, 280, (3,), generator=gen))
    return torch.cat(parts)


def hf_vl_kwargs(ids: torch.Tensor, images: dict | None) -> dict:
    """The keyword arguments transformers' forward and generate take for one prompt."""
    if not images:
        return {}
    return dict(images, mm_token_type_ids=(ids == IMAGE).int()[None])
