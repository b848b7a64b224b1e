"""Qwen2.5-VL and Qwen3-VL against transformers: a tiny random `*ForConditionalGeneration` of each,
built in code, saved with save_pretrained, loaded natively; logits equal in fp32 (1e-4) for one
image, two images, a prompt without images and a packed stream of such documents; the export is
loaded back by transformers. Pixels come from transformers' own image processors. Qwen2.5-VL's
windows are small enough that some images need padded windows; Qwen3-VL's pictures have grids other
than its learned position table's side (resampled), two of its tower's blocks feed DeepStack rows
into the first two decoder layers, and its M-RoPE frequency pairs are interleaved.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from models_testutil import assert_close
from transformers import Qwen2_5_VLForConditionalGeneration, Qwen3VLForConditionalGeneration
from vl3_testutil import processed_images3, tiny_vl3
from vl_testutil import hf_vl_kwargs, processed_images, tiny_vl, vl_prompt

import rlloom.models as models
from rlloom.models.mrope import mrope_positions


@dataclass(frozen=True)
class Family:
    tiny: Callable
    process: Callable[..., dict]
    hf_class: type
    one: tuple[int, int]  # picture sizes (w, h) that fit the family's patch size
    two: tuple[tuple[int, int], tuple[int, int]]


FAMILIES = {
    "qwen2_5_vl": Family(tiny_vl, processed_images, Qwen2_5_VLForConditionalGeneration, (150, 90), ((100, 70), (60, 130))),
    "qwen3_vl": Family(tiny_vl3, processed_images3, Qwen3VLForConditionalGeneration, (160, 96), ((110, 70), (64, 140))),
}  # fmt: skip


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request, tmp_path_factory):
    family = FAMILIES[request.param]
    hf = family.tiny()
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return family, hf, models.from_pretrained(path)


@torch.no_grad()
def _hf_logits(hf, ids: torch.Tensor, images: dict | None) -> torch.Tensor:
    return hf(input_ids=ids[None], **hf_vl_kwargs(ids, images)).logits[0]


@torch.no_grad()
def _native_logits(model, ids: torch.Tensor, images: dict | None) -> torch.Tensor:
    if not images:
        return model(ids)
    grid = images["image_grid_thw"]
    positions = mrope_positions(ids.tolist(), grid.tolist(), model.args.vision)
    return model(ids, position_ids=positions, pixel_values=images["pixel_values"], image_grid_thw=grid)


@pytest.mark.parametrize("case", ["one_image", "two_images", "no_image"])
def test_logits_match_transformers(pair, case):
    family, hf, native = pair
    sizes = {"one_image": [family.one], "two_images": list(family.two), "no_image": []}[case]
    images = family.process(*sizes) if sizes else None
    ids = vl_prompt(images["image_grid_thw"], 1) if images else torch.randint(0, 280, (17,))
    assert_close(_native_logits(native, ids, images), _hf_logits(hf, ids, images))


def test_packed_mixed_documents_match_transformers(pair):
    """Three documents (two images, none, one image) in one packed stream with per-document M-RoPE
    positions: each document's logits equal transformers' on that document alone."""
    family, hf, native = pair
    docs = [family.process(*family.two), None, family.process(family.one)]
    ids = [
        vl_prompt(d["image_grid_thw"], i) if d else torch.randint(0, 280, (11,)) for i, d in enumerate(docs)
    ]
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
    family, hf, native = pair
    models.save_pretrained(native, tmp_path / "export")
    again = family.hf_class.from_pretrained(tmp_path / "export").eval()
    images = family.process(family.one)
    ids = vl_prompt(images["image_grid_thw"], 2)
    assert_close(_hf_logits(again, ids, images), _hf_logits(hf, ids, images), atol=0)


def test_planner_counts_the_vision_tower(pair):
    from rlloom.plan.counts import model_costs

    _, _, native = pair
    costs = model_costs(native.args)
    assert costs.tower_params == sum(p.numel() for p in native.visual.parameters())
    assert costs.total_params == sum(p.numel() for p in native.parameters())
