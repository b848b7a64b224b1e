"""Qwen3-VL against transformers: a tiny random `Qwen3VLForConditionalGeneration` built in code, saved
with save_pretrained, loaded natively; logits equal in fp32 (1e-4) for one image, two images, a
prompt without images and a packed stream of such documents. The pictures' grids differ from the
learned position table's side (resampled), two of the tower's blocks feed DeepStack rows into the
first two decoder layers, and M-RoPE's frequency pairs are interleaved. The export is loaded back
by transformers.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from models_testutil import assert_close
from transformers import Qwen3VLForConditionalGeneration
from vl3_testutil import processed_images3, tiny_vl3
from vl_testutil import hf_vl_kwargs, vl_prompt

import rlloom.models as models
from rlloom.models.mrope import mrope_positions


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf = tiny_vl3()
    path = tmp_path_factory.mktemp("qwen3_vl")
    hf.save_pretrained(path)
    return hf, models.from_pretrained(path)


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


@pytest.mark.parametrize(
    "sizes",
    [[(160, 96)], [(110, 70), (64, 140)], []],
    ids=["one_image", "two_images", "no_image"],
)
def test_logits_match_transformers(pair, sizes):
    hf, native = pair
    images = processed_images3(*sizes) if sizes else None
    ids = vl_prompt(images["image_grid_thw"], 1) if images else torch.randint(0, 280, (17,))
    assert_close(_native_logits(native, ids, images), _hf_logits(hf, ids, images))


def test_packed_mixed_documents_match_transformers(pair):
    """Three documents (two images, none, one image) in one packed stream with per-document M-RoPE
    positions: each document's logits equal transformers' on that document alone."""
    hf, native = pair
    docs = [processed_images3((110, 70), (64, 140)), None, processed_images3((160, 96))]
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
    hf, native = pair
    models.save_pretrained(native, tmp_path / "export")
    again = Qwen3VLForConditionalGeneration.from_pretrained(tmp_path / "export").eval()
    images = processed_images3((160, 96))
    ids = vl_prompt(images["image_grid_thw"], 2)
    assert_close(_hf_logits(again, ids, images), _hf_logits(hf, ids, images), atol=0)


def test_planner_counts_the_vision_tower(pair):
    from rlloom.plan.counts import model_costs

    _, native = pair
    costs = model_costs(native.args)
    assert costs.tower_params == sum(p.numel() for p in native.visual.parameters())
    assert costs.total_params == sum(p.numel() for p in native.parameters())
