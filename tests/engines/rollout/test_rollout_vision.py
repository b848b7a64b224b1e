"""The rollout engine with images (Qwen2.5-VL, Qwen3-VL): greedy tokens equal transformers' generate for
image and text prompts in one batch, each prompt's images go through the vision tower once for its n
samples (Qwen3-VL's DeepStack rows with them), and prefix caching (keyed on token ids) stays off."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[2] / "models"))
from vl3_testutil import processed_images3, tiny_vl3  # noqa: E402
from vl_testutil import hf_vl_kwargs, processed_images, tiny_vl, vl_prompt  # noqa: E402

import rlloom.models as models  # noqa: E402
from rlloom.data.images import ImageInputs  # noqa: E402
from rlloom.engines.rollout.base import SamplingParams  # noqa: E402
from rlloom.engines.rollout.native.engine import NativeEngine  # noqa: E402

NEW = 8


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    hf = tiny_vl()
    path = tmp_path_factory.mktemp("vl")
    hf.save_pretrained(path)
    return hf, path


def _engine(path, **kwargs) -> NativeEngine:
    kwargs = {
        "max_model_len": 128,
        "num_blocks": 64,
        "block_size": 4,
        "seed": 0,
        "eos_token_ids": [],
    } | kwargs
    return NativeEngine(models.from_pretrained(path, fused_projections=True), **kwargs)


def _batch(process=processed_images):
    images = [process((150, 90)), None, process((100, 70), (60, 130), seed=1)]
    ids = [
        vl_prompt(im["image_grid_thw"], i) if im else torch.randint(0, 280, (9,))
        for i, im in enumerate(images)
    ]
    return ids, images


def test_greedy_tokens_equal_transformers_generate(vl):
    hf, path = vl
    ids, images = _batch()
    engine = _engine(path, enable_prefix_caching=True)
    assert not engine.block_manager.enable_prefix_caching  # placeholders are the same ids for every image
    calls = []
    engine.model.visual.register_forward_hook(lambda *_: calls.append(1))
    inputs = [ImageInputs(im["pixel_values"], im["image_grid_thw"]) if im else None for im in images]
    out = engine.generate(
        [x.tolist() for x in ids], SamplingParams(n=3, temperature=0.0, max_new_tokens=NEW), inputs
    )
    assert len(calls) == 2  # once per image prompt, not per sample
    refs = _hf_greedy(hf, ids, images)
    assert [c.token_ids for c in out] == [refs[c.prompt_index] for c in out]
    assert all(c.error is None for c in out)
    # A cache too small for every sequence at once: preempted sequences prefill again, images included.
    tight = _engine(path, num_blocks=24)
    again = tight.generate(
        [x.tolist() for x in ids], SamplingParams(n=3, temperature=0.0, max_new_tokens=NEW), inputs
    )
    assert tight.num_preemptions > 0
    assert [c.token_ids for c in again] == [c.token_ids for c in out]


def _hf_greedy(hf, ids, images) -> list[list[int]]:
    refs = []
    for x, im in zip(ids, images):
        with torch.no_grad():
            ref = hf.generate(
                input_ids=x[None], **hf_vl_kwargs(x, im), do_sample=False, max_new_tokens=NEW,
                min_new_tokens=NEW, eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
        refs.append(ref[0, len(x) :].tolist())
    return refs


def test_qwen3_vl_greedy_tokens_equal_transformers_generate(tmp_path):
    """Qwen3-VL: the prefill adds the prompt's DeepStack rows (computed with its features, once per
    prompt) in the first decoder layers, also when a preempted sequence prefills again."""
    hf = tiny_vl3()
    hf.save_pretrained(tmp_path)
    ids, images = _batch(processed_images3)
    inputs = [ImageInputs(im["pixel_values"], im["image_grid_thw"]) if im else None for im in images]
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=NEW)
    engine = _engine(tmp_path)
    calls = []
    engine.model.visual.register_forward_hook(lambda *_: calls.append(1))
    out = engine.generate([x.tolist() for x in ids], params, inputs)
    assert len(calls) == 2
    refs = _hf_greedy(hf, ids, images)
    assert [c.token_ids for c in out] == [refs[c.prompt_index] for c in out]
    tight = _engine(tmp_path, num_blocks=20)
    again = tight.generate([x.tolist() for x in ids], params, inputs)
    assert tight.num_preemptions > 0
    assert [c.token_ids for c in again] == [c.token_ids for c in out]


def test_images_for_a_model_without_a_tower_abort_the_request(tmp_path):
    from rollout_testutil import save, tiny_dense

    engine = NativeEngine(
        models.from_pretrained(save(tiny_dense(), tmp_path)), max_model_len=64, num_blocks=16
    )
    im = processed_images((56, 56))
    [c] = engine.generate(
        [[1, 2, 3]], SamplingParams(max_new_tokens=2), [ImageInputs(im["pixel_values"], im["image_grid_thw"])]
    )
    assert c.finish_reason == "abort" and "no vision tower" in c.error
