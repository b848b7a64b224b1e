"""The MoE auxiliary load-balancing loss at pp=1 where ranks split each micro-batch's tokens
(train.moe_aux_loss_coef=0.5): on 2 gloo processes, cp=2, tp=2 x ep=2 (each TP rank routes its
own token shard) and tp=2 (each routes the whole stream, padded to a multiple of tp: the padding
rows not counted) equal the one-process engine in fp32 on the tiny 4-layer Qwen3-MoE with skewed
routers of test_pp_aux.py: every gradient of the first forward-backward (the routers' included),
the loss, grad norm and moe/aux_loss of two steps, and the weights after them. The ranks sum their
expert counts before the loss (as the pipeline stages do), so each one's term is its part of the
whole micro-batch's loss; a per-share loss (the fix undone) moves the first layer's router gradient
by 6.7e-4 under cp=2 and 1.8e-3 under tp=2 x ep=2, counting the padding rows 1.5e-4 under tp=2
(its norm: 7.8e-3)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engines" / "train"))
from parallel_helpers import run_gloo  # noqa: E402
from test_pp_aux import cfg, run, skewed_moe  # noqa: E402
from test_pp_aux import check as check_against  # noqa: E402

from rlloom.engines.train.native import NativeTrainEngine  # noqa: E402
from rlloom.parallel import ParallelDims  # noqa: E402

# After two Adam steps at lr 3e-3 these layouts differ from one process by up to 2e-5 even without
# the aux loss (summation order; Adam scales tiny gradients up); a per-share aux loss moves them 1e-2.
WEIGHT_TOL = dict(atol=1e-4, rtol=0)


def check(got: dict, expected: dict, what: str) -> None:
    """Every rank holds every layer at pp=1: all gradients compared."""
    check_against(got, expected, what, whole_model=True, weight_tol=WEIGHT_TOL)


def engine(dims: ParallelDims | None) -> NativeTrainEngine:
    return NativeTrainEngine(
        cfg(share_prompts=False), skewed_moe(), parallel_dims=dims
    )  # CP: plain documents


def worker(rank: int, expected: dict) -> None:
    torch.manual_seed(0)
    check(run(engine(ParallelDims(world_size=2, cp=2))), expected, "pp=1 cp=2")
    torch.manual_seed(0)
    check(run(engine(ParallelDims(world_size=2, tp=2, ep=2))), expected, "pp=1 tp=2 x ep=2")
    torch.manual_seed(0)  # every TP rank routes the whole stream, padded to a multiple of tp
    check(run(engine(ParallelDims(world_size=2, tp=2))), expected, "pp=1 tp=2")


def test_aux_loss_under_cp_and_tp_x_ep_equals_one_process():
    expected = run(engine(None))
    assert all(m["moe/aux_loss"] > 1.1 for m in expected["metrics"]), expected["metrics"]
    run_gloo(worker, 2, expected)
