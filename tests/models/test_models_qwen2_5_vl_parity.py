"""Qwen2.5-VL against transformers: a tiny random `Qwen2_5_VLForConditionalGeneration` built in code,
saved with save_pretrained, loaded natively; logits equal in fp32 (1e-4) for one image, two images,
a prompt without images and a packed stream of such documents. Pixels come from transformers' own
image processor; windows are small enough that some images need padded windows. The export is
loaded back by transformers.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from models_testutil import assert_close, randomize_
from PIL import Image
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

import rlloom.models as models
from rlloom.models.mrope import mrope_positions

VOCAB, IMAGE, START, END = 300, 290, 288, 289


def _hf_config() -> Qwen2_5_VLConfig:
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


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    torch.manual_seed(0)
    hf = randomize_(Qwen2_5_VLForConditionalGeneration(_hf_config())).eval()
    path = tmp_path_factory.mktemp("qwen2_5_vl")
    hf.save_pretrained(path)
    return hf, models.from_pretrained(path), path


def _images(*sizes: tuple[int, int]) -> dict[str, torch.Tensor]:
    gen = np.random.default_rng(0)
    pics = [Image.fromarray(gen.integers(0, 255, (h, w, 3), dtype=np.uint8)) for w, h in sizes]
    processor = Qwen2VLImageProcessorPil(size={"shortest_edge": 28 * 28, "longest_edge": 200 * 200})
    return dict(processor(images=pics, return_tensors="pt"))


def _prompt(grid: torch.Tensor, seed: int) -> torch.Tensor:
    """Text, then each image as <start> image tokens <end> with text between, then text."""
    gen = torch.Generator().manual_seed(seed)
    parts = [torch.randint(0, 280, (5,), generator=gen)]
    for t, h, w in grid.tolist():
        parts += [torch.tensor([START]), torch.full((t * h * w // 4,), IMAGE), torch.tensor([END])]
        parts.append(torch.randint(0, 280, (3,), generator=gen))
    return torch.cat(parts)


@torch.no_grad()
def _hf_logits(hf, ids: torch.Tensor, images: dict | None) -> torch.Tensor:
    kwargs = {}
    if images:
        mm = (ids == IMAGE).int()[None]
        kwargs = dict(images, mm_token_type_ids=mm)
    return hf(input_ids=ids[None], **kwargs).logits[0]


@torch.no_grad()
def _native_logits(model, ids: torch.Tensor, images: dict | None) -> torch.Tensor:
    if not images:
        return model(ids)
    grid = images["image_grid_thw"]
    positions = mrope_positions(ids.tolist(), grid.tolist(), model.args.vision)
    return model(ids, position_ids=positions, pixel_values=images["pixel_values"], image_grid_thw=grid)


@pytest.mark.parametrize(
    "sizes",
    [[(150, 90)], [(100, 70), (60, 130)], []],
    ids=["one_image", "two_images", "no_image"],
)
def test_logits_match_transformers(pair, sizes):
    hf, native, _ = pair
    images = _images(*sizes) if sizes else None
    ids = _prompt(images["image_grid_thw"], 1) if images else torch.randint(0, 280, (17,))
    assert_close(_native_logits(native, ids, images), _hf_logits(hf, ids, images))


def test_packed_mixed_documents_match_transformers(pair):
    """Three documents (two images, none, one image) in one packed stream with per-document M-RoPE
    positions: each document's logits equal transformers' on that document alone."""
    hf, native, _ = pair
    docs = [_images((100, 70), (60, 130)), None, _images((150, 90))]
    ids = [_prompt(d["image_grid_thw"], i) if d else torch.randint(0, 280, (11,)) for i, d in enumerate(docs)]
    positions = [
        mrope_positions(x.tolist(), d["image_grid_thw"].tolist(), native.args.vision)
        if d
        else torch.arange(len(x)).expand(3, -1)
        for x, d in zip(ids, docs)
    ]
    with_images = [d for d in docs if d]
    cu = torch.tensor([0, *np.cumsum([len(x) for x in ids])], dtype=torch.int32)
    with torch.no_grad():
        packed = native(
            torch.cat(ids),
            position_ids=torch.cat(positions, dim=1),
            cu_seqlens=cu,
            pixel_values=torch.cat([d["pixel_values"] for d in with_images]),
            image_grid_thw=torch.cat([d["image_grid_thw"] for d in with_images]),
        )
    expected = torch.cat([_hf_logits(hf, x, d) for x, d in zip(ids, docs)])
    assert_close(packed, expected)


def test_export_loads_in_transformers(pair, tmp_path):
    hf, native, _ = pair
    models.save_pretrained(native, tmp_path / "export")
    again = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path / "export").eval()
    images = _images((150, 90))
    ids = _prompt(images["image_grid_thw"], 2)
    assert_close(_hf_logits(again, ids, images), _hf_logits(hf, ids, images), atol=0)
