"""The MoE auxiliary load-balancing loss under pipeline parallelism (train.moe_aux_loss_coef=0.5):
on 2 gloo processes, pp=2 with 1F1B, with the interleaved schedule (2 virtual stages per rank) and
with zero-bubble plus activation checkpointing equals the one-process engine in fp32 on a tiny
4-layer Qwen3-MoE whose layers 0, 1 and 3 are MoE (each pp rank holds some; one interleaved stage
holds none) and whose routers are skewed, so the balancing loss is above 1.1 and its gradient
moves the routers: every gradient of the first forward-backward (the aux loss's included), the
loss, grad norm and moe/aux_loss of two steps (summed over the pp ranks' layers; the padding to the
token budget and the filler micro-batches not counted), and the weights after them. The loss over
the real rows of a padded stream equals the Switch loss of those rows alone. On 4 processes,
pp=2 x cp=2 equals one process without CP the same way (the cp ranks sum their expert counts)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engines" / "train"))
from parallel_helpers import run_gloo, tiny_args, tiny_model  # noqa: E402
from test_pp_engine import TOL, step  # noqa: E402
from test_train_parallel_gloo import MODE, batches, full_grads, full_weights  # noqa: E402
from train_engine_helpers import PolicyLoss  # noqa: E402

from rlloom.algorithms.losses import loss_normalizer  # noqa: E402
from rlloom.config import ParallelConfig, TrainEngineConfig  # noqa: E402
from rlloom.engines.train.native import NativeTrainEngine  # noqa: E402
from rlloom.models.model import CausalLM  # noqa: E402
from rlloom.models.moe import load_balancing_loss  # noqa: E402
from rlloom.parallel import ParallelDims  # noqa: E402
from rlloom.parallel.pp_aux import real_rows_aux_loss  # noqa: E402
from rlloom.parallel.pp_stages import zero_bubble_supported  # noqa: E402

COEF = 0.5
KEYS = ("train/loss", "train/grad_norm", "moe/aux_loss")
WEIGHT_TOL = dict(atol=1e-5, rtol=0)


def skewed_moe() -> CausalLM:
    """The tiny Qwen3-MoE with 4 layers, layers 0, 1 and 3 MoE, routers scaled up (peaked routing:
    a balancing loss well above 1)."""
    args = tiny_args("qwen3_moe")
    moe = dataclasses.replace(args.moe, sparse_layers=(0, 1, 3))
    args = dataclasses.replace(args, num_layers=4, moe=moe)
    small = tiny_model("qwen3_moe")  # its random norms and embedding, copied to the new layers
    torch.manual_seed(3)
    model = CausalLM(args)
    state = small.state_dict()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in state and state[name].shape == p.shape:
                p.copy_(state[name])
        for layer in model.moe_layers().values():
            layer.router.gate.weight.mul_(8.0)
    return model


def cfg(coef: float = COEF, **changes) -> TrainEngineConfig:
    # lr 3e-3 with Adam: each weight moves ~lr a step, so a wrong aux gradient shows at 1e-5;
    # budget 80 >= the longest sample (71 tokens), so the padding differs between micro-batches.
    return TrainEngineConfig(
        lr=3e-3,
        weight_decay=0.1,
        grad_clip=0.5,
        max_tokens_per_micro_batch=80,
        moe_aux_loss_coef=coef,
        **changes,
    )


def engine_for(pp: int, ac: str = "off", cp: int = 1, **par) -> NativeTrainEngine:
    config = cfg(activation_checkpointing=ac, share_prompts=cp == 1)  # CP splits plain documents only
    if pp == 1:
        return NativeTrainEngine(config, skewed_moe())
    dims = ParallelDims(world_size=pp * cp, pp=pp, cp=cp)
    layout = ParallelConfig(pp=pp, cp=cp, **par)
    return NativeTrainEngine(config, skewed_moe(), parallel_dims=dims, pipeline=layout)


def run(engine: NativeTrainEngine) -> dict:
    data = batches(False)
    normalizer = loss_normalizer(data[0].response_mask(), MODE)
    engine.forward_backward(data[0], PolicyLoss(data[0], MODE), loss_normalizer=normalizer)
    grads = full_grads(engine)
    steps = [step(engine, 1), step(engine, 2)]  # the second: one micro-batch and a filler under pp=2
    metrics = [{k: m[k] for k in KEYS} for m in steps]
    return {"grads": grads, "metrics": metrics, "weights": full_weights(engine)}


def check(
    got: dict, expected: dict, what: str, *, whole_model: bool = False, weight_tol: dict = WEIGHT_TOL
) -> None:
    """`got`'s gradients (this rank's stages only, or with `whole_model` every one), the metrics of
    every step and the full weights against the one-process run's."""
    if whole_model:
        assert got["grads"].keys() == expected["grads"].keys()
    else:
        assert 0 < len(got["grads"]) < len(expected["grads"])  # this rank's stages only
    for name, grad in got["grads"].items():
        torch.testing.assert_close(
            grad, expected["grads"][name], **TOL, msg=lambda m, n=name: f"{what} grad {n}: {m}"
        )
    for i, (a, b) in enumerate(zip(got["metrics"], expected["metrics"], strict=True)):
        for k in KEYS:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), (what, i, k, a[k], b[k])
    for name, t in expected["weights"].items():
        torch.testing.assert_close(
            got["weights"][name], t, **weight_tol, msg=lambda m, n=name: f"{what} weight {n}: {m}"
        )


def worker(rank: int, expected: dict) -> None:
    torch.manual_seed(0)
    check(run(engine_for(2)), expected, "pp=2 1f1b")
    torch.manual_seed(0)
    check(run(engine_for(2, pp_schedule="interleaved", pp_virtual_stages=2)), expected, "pp=2 interleaved")
    if zero_bubble_supported(torch.__version__):  # refused before torch 2.13 (pp_stages.check_pp)
        torch.manual_seed(0)
        zero_bubble = engine_for(2, ac="full", pp_schedule="zero_bubble", pp_virtual_stages=2)
        check(run(zero_bubble), expected, "pp=2 zero_bubble, activation checkpointing")


def test_pp_aux_loss_equals_one_process_with_1f1b_and_interleaved():
    expected = run(engine_for(1))
    # The setting exercises the aux loss: skewed routing, and a router gradient it dominates.
    assert all(m["moe/aux_loss"] > 1.1 for m in expected["metrics"]), expected["metrics"]
    plain = NativeTrainEngine(cfg(0.0), skewed_moe())
    data = batches(False)
    normalizer = loss_normalizer(data[0].response_mask(), MODE)
    plain.forward_backward(data[0], PolicyLoss(data[0], MODE), loss_normalizer=normalizer)
    gate = "layers.0.moe.router.gate.weight"
    without_aux = full_grads(plain)[gate]
    assert not torch.allclose(without_aux, expected["grads"][gate], atol=1e-3)
    run_gloo(worker, 2, expected)


def test_real_rows_aux_loss_is_the_switch_loss_of_the_real_rows():
    g = torch.Generator().manual_seed(0)
    scores_TE = torch.rand(10, 4, generator=g).softmax(dim=-1).requires_grad_()
    experts_TK = torch.randint(0, 4, (10, 2), generator=g)
    real_T = torch.tensor([True] * 3 + [False] * 2 + [True] * 4 + [False])
    got, n = real_rows_aux_loss(scores_TE, experts_TK, real_T)
    assert n == 7
    counts_E = torch.bincount(experts_TK[real_T].flatten(), minlength=4)
    expected = load_balancing_loss(scores_TE[real_T], counts_E, 2)
    torch.testing.assert_close(got, expected)
    (grad,) = torch.autograd.grad(got, scores_TE)
    (expected_grad,) = torch.autograd.grad(expected, scores_TE)
    torch.testing.assert_close(grad, expected_grad)
    assert grad[~real_T].abs().sum() == 0


def worker_cp(rank: int, expected: dict) -> None:
    torch.manual_seed(0)
    check(run(engine_for(2, cp=2)), expected, "pp=2 x cp=2")


@pytest.mark.slow
def test_pp_aux_loss_under_cp_equals_one_process_without_cp():
    """pp=2 x cp=2 (4 processes): the cp ranks sum their expert counts, so each one's term is its
    part of the whole micro-batch's loss and the sum is exact (pp=1 too: test_moe_aux_split.py)."""
    expected = run(NativeTrainEngine(cfg(share_prompts=False), skewed_moe()))
    run_gloo(worker_cp, 4, expected)
