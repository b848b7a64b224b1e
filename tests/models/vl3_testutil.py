"""A tiny random Qwen3-VL for the vision-language tests: three decoder layers of which the first two
take DeepStack rows, a three-block tower with a 4 x 4 learned position table (so every picture's
grid resamples it), pictures through transformers' own image processor (16-pixel patches)."""

from __future__ import annotations

import numpy as np
import torch
from models_testutil import randomize_
from PIL import Image
from transformers import Qwen2VLImageProcessorPil, Qwen3VLConfig, Qwen3VLForConditionalGeneration
from vl_testutil import END, IMAGE, START, VOCAB


def tiny_vl3_config() -> Qwen3VLConfig:
    text = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
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
        patch_size=16,
        num_position_embeddings=16,
        deepstack_visual_indexes=[0, 2],
    )
    return Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE,
        video_token_id=291,
        vision_start_token_id=START,
        vision_end_token_id=END,
    )


def tiny_vl3(seed: int = 0) -> Qwen3VLForConditionalGeneration:
    torch.manual_seed(seed)
    return randomize_(Qwen3VLForConditionalGeneration(tiny_vl3_config()), seed).eval()


def processed_images3(*sizes: tuple[int, int], seed: int = 0) -> dict[str, torch.Tensor]:
    """transformers' processor output (pixel_values, image_grid_thw) of random pictures of (w, h), at
    Qwen3-VL's 16-pixel patches."""
    gen = np.random.default_rng(seed)
    pics = [Image.fromarray(gen.integers(0, 255, (h, w, 3), dtype=np.uint8)) for w, h in sizes]
    processor = Qwen2VLImageProcessorPil(
        patch_size=16, size={"shortest_edge": 32 * 32, "longest_edge": 224 * 224}
    )
    return dict(processor(images=pics, return_tensors="pt"))
