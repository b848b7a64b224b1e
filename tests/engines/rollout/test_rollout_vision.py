"""The rollout engine with images (Qwen2.5-VL, Qwen3-VL): greedy tokens equal transformers' generate for
image and text prompts in one batch, each prompt's images go through the vision tower once for its n
samples (Qwen3-VL's DeepStack rows with them), and prefix caching keys its blocks on the pictures:
the same placeholder ids of another picture miss, the same picture hits and samples what a
recomputed prefill does."""

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


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_prefix_cache_keys_blocks_on_their_pictures(family, vl, tmp_path):
    """Two pictures of one size give one prompt the same token ids: the second finds only the text
    block before its picture cached (and answers its own picture), the first picture again finds
    its blocks, and its next turn reuses the whole first turn; every cached prefill samples the
    tokens and logprobs of an engine that recomputes it."""
    path, process = vl[1], processed_images
    if family == "qwen3_vl":
        tiny_vl3().save_pretrained(tmp_path)
        path, process = tmp_path, processed_images3
    a, b = (process((100, 70), seed=s) for s in (1, 2))
    assert torch.equal(a["image_grid_thw"], b["image_grid_thw"])
    ids = vl_prompt(a["image_grid_thw"], 0).tolist()
    first_picture = ids.index(ids[6])  # 5 text tokens, <start>, then the picture's placeholders
    pics = {k: ImageInputs(im["pixel_values"], im["image_grid_thw"]) for k, im in (("a", a), ("b", b))}
    cached, plain = _engine(path, enable_prefix_caching=True), _engine(path)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6, seed=3)

    def both(prompt: list[int], picture: str) -> tuple[list, int]:
        hits = cached.block_manager.num_cached_hits
        [c], [r] = (e.generate([prompt], sampling, [pics[picture]]) for e in (cached, plain))
        assert c.token_ids == r.token_ids
        torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(r.logprobs), atol=1e-5, rtol=0)
        return c, cached.block_manager.num_cached_hits - hits

    first, saved = both(ids, "a")
    assert saved == 0
    other, saved = both(ids, "b")
    assert saved == 4 * (first_picture // 4)  # the text block before the picture, nothing after it
    assert (torch.tensor(other.logprobs) - torch.tensor(first.logprobs)).abs().max() > 1e-3
    _, saved = both(ids, "a")
    assert saved == 4 * ((len(ids) - 1) // 4)
    turn = ids + first.token_ids + [40, 41, 42]
    _, saved = both(turn, "a")
    assert saved == 4 * ((len(ids) + 6 - 1) // 4)  # the first turn's prompt and response
    assert plain.block_manager.num_cached_hits == 0


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
