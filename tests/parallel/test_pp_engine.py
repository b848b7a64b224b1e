"""The training engine with pipeline parallelism (parallel.pp=2) on 2 gloo processes equals the
one-process engine in fp32: logprobs and entropies, every gradient (each rank its stages', a tied
embedding's gradient summed over its two copies), losses and grad norms of two steps (same metrics
on both pp ranks) and the weights `named_weights` gives (the whole model on every rank). A pp=2
checkpoint resumes in one process and a one-process checkpoint at pp=2, each continuing as the
uninterrupted run. On 4 processes, pp=2 x dp=2 with the zero-bubble schedule and 2 virtual
stages per rank (4 layers) equals one process too. The MoE auxiliary loss under PP: test_pp_aux.py."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engines" / "train"))
from parallel_helpers import run_gloo, tiny_model  # noqa: E402
from test_train_parallel_gloo import MODE, batches, compare_weights, full_grads, full_weights  # noqa: E402
from train_engine_helpers import PolicyLoss  # noqa: E402

from rlloom.algorithms.losses import loss_normalizer  # noqa: E402
from rlloom.config import (  # noqa: E402
    ConfigError,
    ParallelConfig,
    TrainEngineConfig,
    load_config,  # noqa: E402
)
from rlloom.engines.train.base import ForwardOptions
from rlloom.engines.train.build import check_parallel
from rlloom.engines.train.native import NativeTrainEngine  # noqa: E402
from rlloom.models.model import CausalLM  # noqa: E402
from rlloom.parallel import ParallelDims  # noqa: E402
from rlloom.parallel.pp_stages import zero_bubble_supported  # noqa: E402
from rlloom.trainer.preflight import model_hf_config  # noqa: E402

TOL = dict(atol=1e-5, rtol=1e-5)
KEYS = ("train/loss", "train/grad_norm", "train/tokens", "train/response_tokens", "loss/ratio_high_frac")


def cfg(**changes) -> TrainEngineConfig:
    # lr 3e-2: a wrong gradient moves the weights visibly; budget 80 >= the longest sample (71 tokens)
    return TrainEngineConfig(
        lr=3e-2, weight_decay=0.1, grad_clip=0.5, max_tokens_per_micro_batch=80, **changes
    )


def four_layer_model() -> CausalLM:
    """The tiny qwen3 with 4 layers (2 virtual stages on each of 2 pp ranks), layers 2-3 perturbed copies."""
    small = tiny_model("qwen3")
    torch.manual_seed(1)
    model = CausalLM(dataclasses.replace(small.args, num_layers=4))
    state = small.state_dict()
    with torch.no_grad():
        for name, p in model.named_parameters():
            src = name.replace("layers.2.", "layers.0.").replace("layers.3.", "layers.1.")
            p.copy_(state[src] + (0.05 * torch.randn_like(p) if src != name else 0))
    return model


def engine_for(pp: int, world: int = 2, layers: int = 2, **par) -> NativeTrainEngine:
    model = tiny_model("qwen3") if layers == 2 else four_layer_model()
    if pp == 1:
        return NativeTrainEngine(cfg(), model)
    layout = ParallelConfig(pp=pp, **par)
    return NativeTrainEngine(
        cfg(), model, parallel_dims=ParallelDims(world_size=world, pp=pp), pipeline=layout
    )


def step(engine: NativeTrainEngine, i: int) -> dict[str, float]:
    batch = batches(False)[i]
    normalizer = loss_normalizer(batch.response_mask(), MODE)
    return engine.train_step(
        batch, PolicyLoss(batch, MODE), loss_normalizer=normalizer, options=ForwardOptions(with_entropy=True)
    )


def run(engine: NativeTrainEngine) -> dict:
    data = batches(False)
    logp, entropy = engine.forward_logprobs(data[0], options=ForwardOptions(with_entropy=True))
    normalizer = loss_normalizer(data[0].response_mask(), MODE)
    engine.forward_backward(
        data[0],
        PolicyLoss(data[0], MODE),
        loss_normalizer=normalizer,
        options=ForwardOptions(with_entropy=True),
    )
    if engine.pipe is not None:
        engine.pipe.clip_grad_norm_(0.0)  # sums the tied embedding's two gradients (measures only)
    grads = full_grads(engine)
    steps = [step(engine, 0), step(engine, 1)]
    metrics = [{k: m[k] for k in KEYS} for m in steps]
    return {
        "last": steps[-1],
        "logp": logp,
        "entropy": entropy,
        "grads": grads,
        "metrics": metrics,
        "weights": full_weights(engine),
    }


def check(got: dict, expected: dict, what: str) -> None:
    torch.testing.assert_close(got["logp"], expected["logp"], **TOL, msg=f"{what} logp")
    torch.testing.assert_close(got["entropy"], expected["entropy"], **TOL, msg=f"{what} entropy")
    assert 0 < len(got["grads"]) < len(expected["grads"])  # this rank's stages only
    for name, grad in got["grads"].items():
        torch.testing.assert_close(grad, expected["grads"][name], **TOL, msg=f"{what} grad {name}")
    for i, (a, b) in enumerate(zip(got["metrics"], expected["metrics"])):
        for k in b:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), (what, i, k, a[k], b[k])
    compare_weights(got["weights"], expected["weights"], what)


def worker(rank: int, expected: dict, tmp: str) -> None:
    torch.manual_seed(0)
    engine = engine_for(2)
    got = run(engine)
    check(got, expected, "pp=2")
    last = got["last"]  # PP metrics: the token slots filled, and the lightest rank's memory
    assert 0 < last["perf/pp_budget_fill"] <= 1
    assert 0 < last["memory/peak_rss_gib_min_rank"] <= last["memory/peak_rss_gib"]
    layouts = engine.weight_layouts()  # under PP: every stage's, as named_weights gives them, in that order
    assert list(layouts) == list(got["weights"])
    engine.save(os.path.join(tmp, "pp2"))
    resumed = engine_for(2)
    resumed.load(os.path.join(tmp, "one"))
    assert resumed.version == 2
    step(resumed, 2)
    compare_weights(full_weights(resumed), expected["step3"], "one process -> pp=2")


def test_pp_virtual_stages_need_an_interleaved_schedule():
    with pytest.raises(
        ConfigError, match=r"parallel.pp_virtual_stages=2 .*Fix: use parallel.pp_schedule=interleaved"
    ):
        ParallelConfig(pp=2, pp_virtual_stages=2, pp_schedule="1f1b")  # named: the default turns interleaved


def test_pp_needs_a_budget_that_holds_the_longest_sample():
    with pytest.raises(
        ConfigError, match=r"train.max_tokens_per_micro_batch=100 is invalid: .* = 256 \+ 8 = 264\."
    ):
        load_config(
            "arithmetic_smoke",
            [
                "cluster.mode=ray",
                "cluster.num_workers=2",
                "parallel.pp=2",
                "train.max_tokens_per_micro_batch=100",
            ],
        )


def test_pipeline_settings_are_checked_against_the_model(tiny_checkpoint):
    def check(*overrides):
        cfg = load_config(
            "arithmetic_smoke", [f"model.path={tiny_checkpoint}", "cluster.mode=ray", *overrides]
        )
        check_parallel(cfg, model_hf_config(cfg.model.path))

    check("cluster.num_workers=4", "parallel.pp=2")  # 2 layers: pp=2 x dp=2 fits
    with pytest.raises(
        ConfigError, match=r"pp_first_stage_layers=2 .*leave 0 of the model's 2 layers.*pp 2 x dp"
    ):
        check("cluster.num_workers=2", "parallel.pp=2", "parallel.pp_first_stage_layers=2")
    with pytest.raises(ConfigError, match=r"= 4 stages, but the model has 2 layers.*num_hidden_layers=2"):
        check(
            "cluster.num_workers=2",
            "parallel.pp=2",
            "parallel.pp_schedule=interleaved",
            "parallel.pp_virtual_stages=2",
        )


@pytest.mark.slow
def test_pp_engine_equals_one_process_and_checkpoints_cross_pp(tmp_path):
    engine = engine_for(1)
    expected = run(engine)
    engine.save(str(tmp_path / "one"))
    step(engine, 2)
    expected["step3"] = full_weights(engine)
    run_gloo(worker, 2, expected, str(tmp_path))
    # pp=2 -> one process: step 3 after the resume gives the uninterrupted run's weights.
    single = engine_for(1)
    single.load(str(tmp_path / "pp2"))
    assert single.version == 2
    step(single, 2)
    compare_weights(full_weights(single), expected["step3"], "pp=2 -> one process")


def worker_4(rank: int, expected: dict) -> None:
    torch.manual_seed(0)
    engine = engine_for(2, world=4, layers=4, pp_schedule="zero_bubble", pp_virtual_stages=2)
    assert engine.dp_size == 2
    check(run(engine), expected, "pp=2 x dp=2 zero_bubble")


@pytest.mark.slow
@pytest.mark.skipif(not zero_bubble_supported(torch.__version__), reason="zero_bubble needs torch >= 2.13")
def test_pp_times_dp_with_zero_bubble_and_virtual_stages_equals_one_process():
    run_gloo(worker_4, 4, run(engine_for(1, layers=4)))
