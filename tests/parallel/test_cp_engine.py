"""The training engine with context parallelism (parallel.cp=2) on 2 gloo processes equals the
one-process engine in fp32: logprobs and entropies, every gradient, the losses, grad norms and
token counts of two steps and the weights after them, for a dense model and an MoE model with
routing replay, and with activation checkpointing; also tp=2 x cp=2 on 4 processes. Micro-batches
hold several documents, each cut over the cp ranks (one document longer than the budget). The
shared-prompt layout is refused with the fix."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engines" / "train"))
from parallel_helpers import run_gloo, tiny_model  # noqa: E402
from test_train_parallel_gloo import MODE, batches, cfg, compare, full_grads, full_weights, step  # noqa: E402
from train_engine_helpers import PolicyLoss  # noqa: E402

from rlloom.algorithms.losses import loss_normalizer  # noqa: E402
from rlloom.engines.train.base import ForwardOptions
from rlloom.engines.train.native import NativeTrainEngine  # noqa: E402
from rlloom.parallel import ParallelDims  # noqa: E402

FAMILIES = ("qwen3", "qwen3_moe")


def run(family: str, dims: ParallelDims | None, **settings: object) -> dict:
    """logprobs/entropy and gradients of batch 0, then two steps: the results to compare."""
    moe = family.endswith("moe")
    config = dataclasses.replace(cfg(), share_prompts=False, **settings)
    engine = NativeTrainEngine(config, tiny_model(family), parallel_dims=dims)
    data = batches(moe)
    logp, entropy = engine.forward_logprobs(data[0], options=ForwardOptions(with_entropy=True))
    loss, normalizer = PolicyLoss(data[0], MODE), loss_normalizer(data[0].response_mask(), MODE)
    engine.forward_backward(
        data[0],
        loss,
        loss_normalizer=normalizer,
        options=ForwardOptions(with_entropy=True, routing_replay=moe),
    )
    grads = full_grads(engine)
    metrics = [step(engine, b, moe) for b in data[:2]]
    keys = ("train/loss", "train/grad_norm", "train/tokens", "train/computed_tokens", "train/response_tokens")
    keys += ("loss/ratio_high_frac",) + (("moe/load_max_over_mean",) if moe else ())
    return {
        "logp": logp,
        "entropy": entropy,
        "grads": grads,
        "metrics": [{k: m[k] for k in keys} for m in metrics],
        "weights": full_weights(engine),
    }


def worker(rank: int, expected: dict) -> None:
    for family in FAMILIES:
        compare(run(family, ParallelDims(world_size=2, cp=2)), expected[family], f"{family} cp=2")
    # Activation checkpointing recomputes the layers, all-gathers included, in backward.
    ac = run("qwen3", ParallelDims(world_size=2, cp=2), activation_checkpointing="full")
    compare(ac, expected["qwen3"], "qwen3 cp=2 with activation checkpointing")
    with pytest.raises(
        ValueError, match=r"train.share_prompts=true .*parallel.cp=2.*Fix: set train.share_prompts=false"
    ):
        # asked for by name (its default, null, turns off under CP)
        shared = dataclasses.replace(cfg(), share_prompts=True)
        NativeTrainEngine(shared, tiny_model("qwen3"), parallel_dims=ParallelDims(world_size=2, cp=2))


@pytest.mark.slow
def test_cp_engine_equals_one_process():
    expected = {family: run(family, None) for family in FAMILIES}
    run_gloo(worker, 2, expected)


def tp_cp_worker(rank: int, expected: dict) -> None:
    got = run("qwen3_moe", ParallelDims(world_size=4, tp=2, cp=2))
    compare(got, expected, "qwen3_moe tp=2 x cp=2")


@pytest.mark.slow
def test_cp_with_tensor_parallelism_equals_one_process():
    """tp=2 x cp=2 on 4 processes: sequence parallelism splits each rank's share (padded to a
    multiple of tp) and the attention heads; MoE routes replayed."""
    run_gloo(tp_cp_worker, 4, run("qwen3_moe", None))


def default_packing_worker(rank: int, _: None) -> None:
    engine = NativeTrainEngine(cfg(), tiny_model("qwen3"), parallel_dims=ParallelDims(world_size=2, cp=2))
    assert engine.cfg.share_prompts is False


def test_cp_turns_the_default_shared_prompt_packing_off():
    """train.share_prompts left at its default (null) packs shared prompts in one process and plainly
    under CP, so parallel.cp=2 alone needs no second setting."""
    assert cfg().share_prompts is None
    assert NativeTrainEngine(cfg(), tiny_model("qwen3")).cfg.share_prompts is True
    run_gloo(default_packing_worker, 2, None)
