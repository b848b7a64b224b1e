"""Qwen2.5-VL and Qwen3-VL on a CUDA GPU against transformers' model on the same GPU: the native model's
logits on an image prompt (the tower's padded-window SDPA on CUDA; Qwen3-VL's DeepStack rows) and the
rollout engine's greedy tokens against transformers' generate, fp32. Skipped without a GPU."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
sys.path.insert(0, str(Path(__file__).parents[1] / "models"))


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_vl_logits_and_greedy_rollout_on_cuda(family, tmp_path):
    from vl3_testutil import processed_images3, tiny_vl3
    from vl_testutil import hf_vl_kwargs, processed_images, tiny_vl, vl_prompt

    import rlloom.models as models
    from rlloom.data.images import ImageInputs
    from rlloom.engines.rollout.native import NativeEngine, SamplingParams
    from rlloom.models.mrope import mrope_positions

    tiny, process = (tiny_vl, processed_images) if family == "qwen2_5_vl" else (tiny_vl3, processed_images3)
    hf = tiny()
    hf.save_pretrained(tmp_path)
    im = process((150, 90), (60, 130))
    ids = vl_prompt(im["image_grid_thw"], 0)
    # transformers' model on the same GPU: its own CPU and GPU logits differ by up to 1.6e-3 on the
    # tiny Qwen3-VL (measured on an H200), the native model's and its on the GPU by 0.
    hf = hf.cuda()
    hf_kwargs = {k: v.cuda() if torch.is_tensor(v) else v for k, v in hf_vl_kwargs(ids, im).items()}
    with torch.no_grad():
        ref = hf(input_ids=ids[None].cuda(), **hf_kwargs).logits[0].cpu()
        native = models.from_pretrained(tmp_path, device="cuda")
        positions = mrope_positions(ids.tolist(), im["image_grid_thw"].tolist(), native.args.vision)
        got = native(ids.cuda(), position_ids=positions.cuda(), pixel_values=im["pixel_values"].cuda(),
                     image_grid_thw=im["image_grid_thw"])  # fmt: skip
    assert (got.cpu() - ref).abs().max() < 1e-4
    engine = NativeEngine.from_pretrained(tmp_path, device="cuda", max_model_len=128, num_blocks=64,
                                          eos_token_ids=[])  # fmt: skip
    [c] = engine.generate([ids.tolist()], SamplingParams(temperature=0.0, max_new_tokens=8),
                          [ImageInputs(im["pixel_values"], im["image_grid_thw"])])  # fmt: skip
    with torch.no_grad():
        out = hf.generate(input_ids=ids[None].cuda(), **hf_kwargs, do_sample=False, max_new_tokens=8,
                          min_new_tokens=8, eos_token_id=None, pad_token_id=0)  # fmt: skip
    assert c.token_ids == out[0, len(ids) :].tolist()
    assert engine.runner.graphs is not None and engine.runner.graphs.graphs, "the VL decode ran eagerly"


def test_vl_decode_graphs_shift_each_sequences_positions(tmp_path):
    """The decode CUDA graphs carry M-RoPE's per-sequence shift: a batch of an image prompt, a
    two-image prompt and an image-free one decodes to the eager engine's tokens (fp32, greedy)."""
    from vl_testutil import processed_images, tiny_vl, vl_prompt

    from rlloom.data.images import ImageInputs
    from rlloom.engines.rollout.native import NativeEngine, SamplingParams

    tiny_vl().save_pretrained(tmp_path)
    one, two = processed_images((150, 90)), processed_images((60, 130), (90, 90))
    prompts = [vl_prompt(one["image_grid_thw"], 1).tolist(), vl_prompt(two["image_grid_thw"], 2).tolist()]
    prompts.append(vl_prompt(torch.zeros(0, 3, dtype=torch.long), 3).tolist())
    images = [ImageInputs(im["pixel_values"], im["image_grid_thw"]) for im in (one, two)] + [None]
    sp = SamplingParams(temperature=0.0, max_new_tokens=12)
    kw = dict(device="cuda", max_model_len=160, num_blocks=64, eos_token_ids=[])
    graphs = NativeEngine.from_pretrained(tmp_path, **kw)
    replayed = graphs.generate(prompts, sp, images)
    assert graphs.runner.graphs is not None and graphs.runner.graphs.graphs
    eager = NativeEngine.from_pretrained(tmp_path, enforce_eager=True, **kw).generate(prompts, sp, images)
    assert [c.token_ids for c in replayed] == [c.token_ids for c in eager]


def test_vl_training_engine_on_pictures_on_cuda(tmp_path):
    """The training engine on CUDA: fp32 logprobs of a packed batch of picture and text documents equal
    transformers' on the CPU per document (1e-3), and bf16 train steps move the tower and keep it put
    under train.freeze_vision."""
    from vl_testutil import hf_vl_kwargs, processed_images, tiny_vl, vl_prompt

    import rlloom.models as models
    from rlloom.config import TrainEngineConfig
    from rlloom.data.images import ImageInputs
    from rlloom.data.types import RolloutBatch, Sample
    from rlloom.engines.train.base import ForwardOptions
    from rlloom.engines.train.native import NativeTrainEngine

    hf = tiny_vl()
    hf.save_pretrained(tmp_path)
    two, one = processed_images((100, 70), (60, 130)), processed_images((150, 90), seed=1)
    docs = [(vl_prompt(two["image_grid_thw"], 0), two), (torch.randint(0, 280, (9,)), None)]
    docs.append((vl_prompt(one["image_grid_thw"], 2), one))
    samples = [
        Sample(
            prompt_ids=ids.tolist(),
            response_ids=torch.randint(0, 280, (6,)).tolist(),
            group_id=g,
            images=ImageInputs(im["pixel_values"], im["image_grid_thw"]) if im else None,
        )
        for g, (ids, im) in enumerate(docs + docs[:1])
    ]
    batch = RolloutBatch(samples)
    engine = NativeTrainEngine(
        TrainEngineConfig(compile=False), models.from_pretrained(tmp_path), device="cuda", dtype=torch.float32
    )
    logp_BT, _ = engine.forward_logprobs(batch, options=ForwardOptions(temperature=1.0))
    for b, (s, (ids, im)) in enumerate(zip(samples, docs + docs[:1])):
        full = torch.tensor(s.token_ids)
        with torch.no_grad():
            logits = hf(input_ids=full[None], **hf_vl_kwargs(full, im)).logits[0]
        ref = logits[len(ids) - 1 : -1].log_softmax(-1).gather(1, torch.tensor(s.response_ids)[:, None])[:, 0]
        assert (logp_BT[b, : len(ref)] - ref).abs().max() < 1e-3, b
    mask_BT = batch.response_mask()
    loss = dict(
        loss_fn=lambda logp_bT, entropy_bT, rows: (-(logp_bT * mask_BT[rows].cuda()).sum(), {}),
        loss_normalizer=float(mask_BT.sum()),
    )
    for freeze in (False, True):
        engine = NativeTrainEngine(
            TrainEngineConfig(lr=1e-2, freeze_vision=freeze),
            models.from_pretrained(tmp_path),
            device="cuda",
            dtype=torch.bfloat16,
        )
        before = engine.model.visual.merger.mlp[0].weight.detach().clone()
        metrics = engine.train_step(batch, **loss)
        assert math.isfinite(metrics["train/grad_norm"]) and metrics["train/grad_norm"] > 0
        assert torch.equal(engine.model.visual.merger.mlp[0].weight, before) == freeze


def test_vl_prefix_cache_on_cuda_keys_on_pictures_and_samples_what_recomputing_does(tmp_path):
    """Prefix caching with the decode CUDA graphs: a picture of the same size (the same token ids)
    finds only the text block before it cached, the same picture's next turn reuses the first turn's
    blocks, and every turn samples the tokens (and logprobs, 1e-4) of an engine that recomputes."""
    from vl_testutil import processed_images, tiny_vl, vl_prompt

    from rlloom.data.images import ImageInputs
    from rlloom.engines.rollout.native import NativeEngine, SamplingParams

    tiny_vl().save_pretrained(tmp_path)
    a, b = (processed_images((100, 70), seed=s) for s in (1, 2))
    ids = vl_prompt(a["image_grid_thw"], 0).tolist()
    pics = {k: ImageInputs(im["pixel_values"], im["image_grid_thw"]) for k, im in (("a", a), ("b", b))}
    engines = [
        NativeEngine.from_pretrained(tmp_path, device="cuda", max_model_len=128, num_blocks=64, block_size=4,
                                     seed=0, eos_token_ids=[], enable_prefix_caching=caching)
        for caching in (True, False)
    ]  # fmt: skip
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6, seed=3)

    def both(prompt: list[int], picture: str) -> tuple[list[int], int]:
        before = engines[0].block_manager.num_cached_hits
        [c], [r] = (e.generate([prompt], sampling, [pics[picture]]) for e in engines)
        assert c.token_ids == r.token_ids
        assert max(abs(x - y) for x, y in zip(c.logprobs, r.logprobs)) < 1e-4
        return c.token_ids, engines[0].block_manager.num_cached_hits - before

    first, hit_a = both(ids, "a")
    _, hit_b = both(ids, "b")
    _, hit_turn = both(ids + first + [40, 41, 42], "a")
    assert (hit_a, hit_b, hit_turn) == (0, 4, 4 * ((len(ids) + 6 - 1) // 4))
    assert engines[0].runner.graphs is not None and engines[0].runner.graphs.graphs
