"""The training engine on pictures (Qwen2.5-VL): a packed batch of image and text documents gives each
document the logprobs transformers' `Qwen2_5_VLForConditionalGeneration` gives it alone (fp32, 1e-4),
in the sequence and the shared-prompt layouts and at any micro-batch budget; the rollout engine's
logprobs of its own samples equal the training engine's; and train.freeze_vision keeps the tower as
loaded (no gradient, no optimizer state) while the decoder trains."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[2] / "models"))
from vl3_testutil import processed_images3, tiny_vl3  # noqa: E402
from vl_testutil import hf_vl_kwargs, processed_images, tiny_vl, vl_prompt  # noqa: E402

import rlloom.models as models  # noqa: E402
from rlloom.config import TrainEngineConfig  # noqa: E402
from rlloom.data.images import ImageInputs  # noqa: E402
from rlloom.data.types import RolloutBatch, Sample  # noqa: E402
from rlloom.engines.rollout.base import SamplingParams  # noqa: E402
from rlloom.engines.rollout.native.engine import NativeEngine  # noqa: E402
from rlloom.engines.train.base import ForwardOptions  # noqa: E402
from rlloom.engines.train.native import NativeTrainEngine  # noqa: E402


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    hf = tiny_vl()
    path = tmp_path_factory.mktemp("vl_train")
    hf.save_pretrained(path)
    return hf, path


@pytest.fixture(scope="module")
def vl3(tmp_path_factory):
    hf = tiny_vl3()
    path = tmp_path_factory.mktemp("vl3_train")
    hf.save_pretrained(path)
    return hf, path


def _inputs(images: dict | None) -> ImageInputs | None:
    return ImageInputs(images["pixel_values"], images["image_grid_thw"]) if images else None


def _batch(processed=processed_images) -> RolloutBatch:
    """Two samples of a two-image prompt, a text prompt, a one-image prompt, then the two-image prompt
    again in another group (`processed`: the family's image processor)."""
    two, one = processed((100, 70), (60, 130)), processed((150, 90), seed=1)
    gen = torch.Generator().manual_seed(3)  # the same batch in every process
    prompts = [(vl_prompt(two["image_grid_thw"], 0), two), (torch.randint(0, 280, (9,), generator=gen), None)]
    prompts.append((vl_prompt(one["image_grid_thw"], 2), one))
    samples = []
    for gid, (ids, images) in enumerate([prompts[0], prompts[0], prompts[1], prompts[2], prompts[0]]):
        response = torch.randint(0, 280, (int(torch.randint(1, 9, (1,), generator=gen)),), generator=gen)
        samples.append(
            Sample(
                prompt_ids=ids.tolist(),
                response_ids=response.tolist(),
                group_id=min(gid, 1) if gid < 2 else gid,
                images=_inputs(images),
            )
        )
    return RolloutBatch(samples)


@torch.no_grad()
def _hf_logprobs(hf, sample: Sample) -> torch.Tensor:
    ids = torch.tensor(sample.token_ids)
    images = None
    if sample.images is not None:
        images = {"pixel_values": sample.images.pixel_values, "image_grid_thw": sample.images.grid_thw}
    logits = hf(input_ids=ids[None], **hf_vl_kwargs(ids, images)).logits[0].float()
    p = len(sample.prompt_ids)
    logp = logits[p - 1 : -1].log_softmax(-1)
    return logp.gather(1, torch.tensor(sample.response_ids)[:, None]).squeeze(1)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("share_prompts", [False, True])
@pytest.mark.parametrize("budget", [1, 4096])
def test_packed_image_and_text_documents_equal_transformers(request, family, share_prompts, budget):
    """Qwen3-VL: DeepStack rows reach the image tokens through the same stream rows."""
    hf, path = request.getfixturevalue("vl" if family == "qwen2_5_vl" else "vl3")
    batch = _batch(processed_images if family == "qwen2_5_vl" else processed_images3)
    cfg = TrainEngineConfig(max_tokens_per_micro_batch=budget, share_prompts=share_prompts)
    engine = NativeTrainEngine(cfg, models.from_pretrained(path))
    logp_BT, _ = engine.forward_logprobs(batch, options=ForwardOptions(temperature=1.0))
    for b, sample in enumerate(batch.samples):
        ref = _hf_logprobs(hf, sample)
        torch.testing.assert_close(logp_BT[b, : len(ref)], ref, atol=1e-4, rtol=0, msg=f"sample {b}")


def test_rollout_logprobs_equal_training_logprobs(vl):
    _, path = vl
    two, one = processed_images((100, 70), (60, 130)), processed_images((150, 90), seed=1)
    prompts = [
        vl_prompt(two["image_grid_thw"], 0),
        torch.randint(0, 280, (9,)),
        vl_prompt(one["image_grid_thw"], 2),
    ]
    images = [_inputs(two), None, _inputs(one)]
    rollout = NativeEngine(
        models.from_pretrained(path), max_model_len=128, num_blocks=64, block_size=4, seed=0, eos_token_ids=[]
    )
    out = rollout.generate(
        [p.tolist() for p in prompts], SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=1), images
    )
    samples = [
        Sample(
            prompt_ids=prompts[c.prompt_index].tolist(),
            response_ids=list(c.token_ids),
            rollout_logprobs=list(c.logprobs),
            group_id=c.prompt_index,
            images=images[c.prompt_index],
        )
        for c in out
    ]
    batch = RolloutBatch(samples)
    engine = NativeTrainEngine(TrainEngineConfig(), models.from_pretrained(path))
    logp_BT, _ = engine.forward_logprobs(batch, options=ForwardOptions(temperature=1.0))
    mask = batch.response_mask()
    gap = (logp_BT - batch.rollout_logprobs())[mask].abs().max()
    assert gap < 1e-5, gap


def _loss(batch: RolloutBatch) -> dict:
    mask_BT = batch.response_mask()
    loss_fn = lambda logp_bT, entropy_bT, rows: (-(logp_bT * mask_BT[rows]).sum(), {})
    return dict(loss_fn=loss_fn, loss_normalizer=float(mask_BT.sum()))


@pytest.mark.parametrize("freeze", [False, True])
def test_freeze_vision_keeps_the_tower_as_loaded(vl, freeze):
    """With train.freeze_vision the tower's parameters get no gradient and no optimizer state and keep
    their values over two steps while the decoder trains; without it the tower trains on the pictures."""
    _, path = vl
    engine = NativeTrainEngine(
        TrainEngineConfig(lr=1e-2, freeze_vision=freeze), models.from_pretrained(path), total_steps=2
    )
    tower = dict(engine.model.visual.named_parameters())
    start = {name: p.detach().clone() for name, p in tower.items()}
    decoder = engine.model.norm.weight.detach().clone()
    batch = _batch()
    engine.forward_backward(batch, **_loss(batch))
    assert all((p.grad is None) == freeze for p in tower.values())
    optimized = {id(p) for p in engine.optimizer.params}
    assert all((id(p) not in optimized) == freeze for p in tower.values())
    for _ in range(2):
        engine.train_step(batch, **_loss(batch))
    unchanged = [torch.equal(p, start[name]) for name, p in tower.items()]
    assert all(unchanged) if freeze else not any(unchanged)
    assert not torch.equal(engine.model.norm.weight, decoder)


def _mixed_pair() -> RolloutBatch:
    """A picture sample and a text sample: under dp=2 one rank holds no picture at all."""
    batch = _batch()
    return RolloutBatch([batch.samples[0], batch.samples[2]])


def _dp2_worker(rank: int, port: int, path: str, expected: dict) -> None:
    import os

    import torch.distributed as dist

    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": "2"}
    try:
        engine = NativeTrainEngine(TrainEngineConfig(lr=1e-2), models.from_pretrained(path), total_steps=2)
        assert engine.sharded and engine.dp_size == 2
        batch = _mixed_pair()
        metrics = engine.train_step(batch, **_loss(batch))
        assert metrics["train/grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5), (
            metrics["train/grad_norm"],
            expected["grad_norm"],
        )
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_two_ranks_one_without_pictures_equal_one_process(vl):
    """FSDP2 on gloo, one rank's micro-batches without a picture (its tower gets no gradient): the
    step's gradient norm (the tower's gradients included) equals the one-process step's."""
    from procs import free_port, spawn

    _, path = vl
    single = NativeTrainEngine(TrainEngineConfig(lr=1e-2), models.from_pretrained(path), total_steps=2)
    batch = _mixed_pair()
    expected = {"grad_norm": single.train_step(batch, **_loss(batch))["train/grad_norm"]}
    spawn(_dp2_worker, args=(free_port(), str(path), expected), nprocs=2, join=True)


@pytest.mark.parametrize("kind", ["tiny-vl", "tiny-vl3"])
def test_each_answer_reads_its_own_picture(kind, tmp_path):
    """The visual_colour task's four prompts (the same token ids, four solid colours) through the data
    pipeline into the model `rlloom init-model` writes (transformers' initialisation, as the recipe
    trains it): the answer position's next-token distribution moves with the picture alone, and the
    rollout engine's logprob of every sample, and the training engine's in one packed batch, are its
    own picture's, not another's (the pictures' answers differ 100x more than the tolerance)."""
    from transformers import AutoTokenizer

    from rlloom.data.chat import tokenize_prompts
    from rlloom.models.checkpoint import load_image_processing
    from rlloom.models.mrope import mrope_positions
    from rlloom.models.tiny import write_tiny_model
    from rlloom.tasks.visual_colour import visual_colour_prompts

    path = write_tiny_model(kind, tmp_path / "model", hidden=64)
    raws = visual_colour_prompts(split="eval", num_train=4, num_eval=4, seed=0, folder=tmp_path / "pictures")
    items = tokenize_prompts(
        raws, AutoTokenizer.from_pretrained(path), chat_template=True, max_prompt_length=128,
        images=load_image_processing(path),
    ).items  # fmt: skip
    assert len({tuple(item.prompt_ids) for item in items}) == 1 and len(items) == 4
    model = models.from_pretrained(path)
    with torch.no_grad():
        answer_PV = torch.stack([
            model(
                torch.tensor(item.prompt_ids), pixel_values=item.images.pixel_values,
                image_grid_thw=item.images.grid_thw,
                position_ids=mrope_positions(item.prompt_ids, item.images.grid_thw.tolist(), model.args.vision),
            )[-1].log_softmax(-1)
            for item in items
        ])  # fmt: skip
    apart_PP = (answer_PV[:, None] - answer_PV[None]).abs().amax(-1)
    assert apart_PP[~torch.eye(4, dtype=torch.bool)].min() > 1e-3, apart_PP

    rollout = NativeEngine(
        models.from_pretrained(path), max_model_len=128, num_blocks=64, block_size=4, seed=0, eos_token_ids=[]
    )
    out = rollout.generate(
        [item.prompt_ids for item in items], SamplingParams(n=4, temperature=1.0, max_new_tokens=1, seed=1),
        [item.images for item in items],
    )  # fmt: skip
    expected_S = answer_PV[[c.prompt_index for c in out], [c.token_ids[0] for c in out]]
    rollout_S = torch.tensor([c.logprobs[0] for c in out])
    torch.testing.assert_close(rollout_S, expected_S, atol=1e-5, rtol=0)

    batch = RolloutBatch([
        Sample(prompt_ids=items[c.prompt_index].prompt_ids, response_ids=list(c.token_ids),
               group_id=c.prompt_index, images=items[c.prompt_index].images)
        for c in out
    ])  # fmt: skip
    engine = NativeTrainEngine(TrainEngineConfig(share_prompts=True), models.from_pretrained(path))
    logp_BT, _ = engine.forward_logprobs(batch, options=ForwardOptions(temperature=1.0))
    torch.testing.assert_close(logp_BT[:, 0], expected_S, atol=1e-5, rtol=0)
