"""The optimizer-step guard (step_guard.py) answers exactly whether the fused AdamW step leaves
every parameter finite, and ordinary steps are certified by the cheap bound, not the trial."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from rlloom.engines.train.native import step_guard
from rlloom.engines.train.native.step_guard import StepGuard, _group_maxima, _next_maxima


def adamw_would_be_finite(optim: torch.optim.Optimizer) -> torch.Tensor:
    """The guard's answer with nothing carried (every maximum read)."""
    return StepGuard().would_be_finite(optim)


def _update_is_bounded(optim: torch.optim.Optimizer, group: dict) -> bool:
    """True when the bound alone certifies this group's step from its maxima read now."""
    params = [p for p in group["params"] if p.grad is not None]
    return _next_maxima(group, *_group_maxima(optim, params, grads=True)) is not None


FMAX = torch.finfo(torch.float32).max
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA fused AdamW needs a GPU"),
    ),
]


def make_optim(
    *,
    lr: float,
    wd: float,
    eps: float,
    betas: tuple[float, float],
    p_scale: float,
    g_scale: float,
    warm: bool,
    device: str = "cpu",
) -> torch.optim.AdamW:
    torch.manual_seed(0)
    shapes = [(3, 4), (5,), (2,)]  # the last gets no gradient: not stepped, not checked
    params = [
        torch.nn.Parameter((torch.randn(s) * (p_scale if i < 2 else 1.0)).to(device))
        for i, s in enumerate(shapes)
    ]
    optim = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, fused=True)
    if warm:  # a first, ordinary step gives the optimizer its state
        for p in params[:2]:
            p.grad = torch.randn_like(p)
        optim.step()
    for p in params[:2]:
        p.grad = torch.randn_like(p) * g_scale
    params[2].grad = None
    optim.param_groups[0].update(lr=lr, weight_decay=wd, eps=eps, betas=betas)
    return optim


def step_is_finite(optim: torch.optim.AdamW) -> bool:
    """Run the real step on a copy (parameters, gradients, state; deepcopy drops the gradients)."""
    trial = copy.deepcopy(optim)
    for p, q in zip(optim.param_groups[0]["params"], trial.param_groups[0]["params"], strict=True):
        q.grad = None if p.grad is None else p.grad.clone()
    trial.step()
    stepped = [q for q in trial.param_groups[0]["params"] if q.grad is not None]
    assert stepped and all(trial.state[q] for q in stepped)  # it did step
    return all(bool(torch.isfinite(q).all()) for q in stepped)


CASES = list(
    itertools.product(
        [1e-3, 1e30, 1e39],  # lr (1e39 is inf in fp32)
        [0.0, 0.1, 1e36],  # weight decay
        [1e-8, 0.0],  # eps
        [(0.9, 0.999), (0.0, 0.0), (1.0, 0.999)],  # betas
        [1.0, 1e38],  # parameter scale
        [1.0, 0.0, 1e20],  # gradient scale (0: m = v = 0; 1e20: g*g overflows)
        [False, True],  # optimizer state present
    )
)


@pytest.mark.parametrize("device", DEVICES)
def test_guard_equals_the_real_step_and_the_bound_is_sufficient(device):
    agree = bounded = trials = 0
    for lr, wd, eps, betas, p_scale, g_scale, warm in CASES:
        optim = make_optim(
            lr=lr, wd=wd, eps=eps, betas=betas, p_scale=p_scale, g_scale=g_scale, warm=warm, device=device
        )
        before = copy.deepcopy([p.detach() for p in optim.param_groups[0]["params"]])
        finite = step_is_finite(optim)
        case = (lr, wd, eps, betas, p_scale, g_scale, warm)
        assert bool(adamw_would_be_finite(optim)) == finite, case
        if _update_is_bounded(optim, optim.param_groups[0]):
            bounded += 1
            assert finite, case  # the bound only ever certifies steps that are finite
        else:
            trials += 1
        after = [p.detach() for p in optim.param_groups[0]["params"]]
        assert all(torch.equal(a, b) for a, b in zip(before, after)), case  # the guard changed nothing
        agree += 1
    # Both paths are exercised, and both outcomes occur.
    assert bounded >= 20 and trials >= 20, (bounded, trials)


@pytest.mark.parametrize("device", DEVICES)
def test_non_finite_optimizer_state_is_caught(device):
    # On CUDA this also checks that the inf-norm reduction propagates NaN.
    optim = make_optim(
        lr=1e-3, wd=0.1, eps=1e-8, betas=(0.9, 0.999), p_scale=1.0, g_scale=1.0, warm=True, device=device
    )
    state = optim.state[optim.param_groups[0]["params"][0]]
    state["exp_avg"][0, 0] = float("nan")
    assert not _update_is_bounded(optim, optim.param_groups[0])
    assert not bool(adamw_would_be_finite(optim)) and not step_is_finite(optim)


def test_ordinary_steps_skip_the_trial(monkeypatch):
    calls = []
    real_trial = step_guard._trial
    monkeypatch.setattr(step_guard, "_trial", lambda *a: calls.append(1) or real_trial(*a))
    for warm in (False, True):
        optim = make_optim(lr=1e-3, wd=0.1, eps=1e-8, betas=(0.9, 0.999), p_scale=1.0, g_scale=1.0, warm=warm)
        assert bool(adamw_would_be_finite(optim))
    assert calls == []
    optim = make_optim(lr=1e39, wd=0.1, eps=1e-8, betas=(0.9, 0.999), p_scale=1.0, g_scale=1.0, warm=True)
    assert not bool(adamw_would_be_finite(optim)) and calls == [1]


@pytest.mark.parametrize("scale", [FMAX / 4, 3e37])
def test_large_but_finite_weights_near_the_limit(scale):
    # Parameters whose size alone is over BOUND_LIMIT: the trial decides, and the step is finite.
    optim = make_optim(lr=1e-3, wd=0.0, eps=1e-8, betas=(0.9, 0.999), p_scale=1.0, g_scale=1.0, warm=True)
    with torch.no_grad():
        optim.param_groups[0]["params"][0].fill_(scale)
    assert bool(adamw_would_be_finite(optim)) == step_is_finite(optim) is True


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_max_abs_equals_the_largest_magnitude(device):
    """The bound's maxima (aminmax on the CPU, an inf-norm on CUDA) against a plain max(|x|): the
    extreme may be negative, an inf counts, a NaN anywhere makes it NaN; empty tensors are skipped."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(37, 5, generator=g), torch.randn(300, generator=g), torch.empty(0)]
    ts[1][17] = -40.0  # the largest magnitude, negative
    cases = [ts, [*ts, torch.tensor([-float("inf"), 1.0])], [*ts, torch.tensor([float("nan"), 1.0])]]
    for tensors in cases:
        want = torch.cat([t.flatten() for t in tensors]).abs().max()
        got = step_guard._max_abs([t.to(device) for t in tensors], torch.device(device))
        assert got.device.type == device
        assert torch.equal(got.cpu(), want) or (want.isnan() and got.isnan())


def _true_maxima(optim: torch.optim.AdamW) -> tuple[float, float, float]:
    params = [p for p in optim.param_groups[0]["params"] if p.grad is not None]
    states = [optim.state[p] for p in params]
    return (
        max(p.detach().abs().max().item() for p in params),
        max(s["exp_avg"].abs().max().item() for s in states),
        max(s["exp_avg_sq"].max().item() for s in states),
    )


def test_carried_bounds_skip_the_reads_and_stay_above_the_truth(monkeypatch):
    # Steps large enough to move the weights (lr 0.05, growing gradients): after the first step the
    # guard certifies each step from the bounds it carried, reading nothing, and those bounds stay
    # at or above the true maxima; reading starts again after `forget`, after a change of the
    # parameters with a gradient, and when the carried bounds no longer certify a step.
    reads = []
    real = step_guard._group_maxima
    monkeypatch.setattr(step_guard, "_group_maxima", lambda *a, **k: reads.append(1) or real(*a, **k))
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(6, 4), (7,)]]
    optim = torch.optim.AdamW(params, lr=0.05, weight_decay=0.1, fused=True)
    guard = step_guard.StepGuard()

    def guarded_step(scale: float) -> bool:
        for p in params:
            p.grad = torch.randn_like(p) * scale
        norm = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in params])).item()
        ok = bool(guard.would_be_finite(optim, grad_max=norm * step_guard.SLACK))
        if ok:
            optim.step()
        guard.settle(ok)
        return ok

    for i in range(8):
        assert guarded_step(1.5**i)
        carried = guard._carried[(id(optim), 0)][1]
        assert all(b >= t for b, t in zip(carried, _true_maxima(optim), strict=True)), (i, carried)
    assert reads == [1]
    guard.forget()
    assert guarded_step(1.0) and reads == [1, 1]
    params[1].requires_grad_(False)  # a parameter leaves the step: its bound must not be assumed
    params[1].grad = None
    p0 = params[0]
    p0.grad = torch.randn_like(p0)
    assert bool(guard.would_be_finite(optim, grad_max=p0.grad.norm().item())) and reads == [1, 1, 1]
    guard.settle(False)
    optim.param_groups[0]["lr"] = 1e39  # the carried bounds fail: read, then the trial refuses
    assert not bool(guard.would_be_finite(optim, grad_max=p0.grad.norm().item())) and reads == [1, 1, 1, 1]
    guard.settle(False)
    assert (id(optim), 0) in guard._carried  # a step not applied keeps the bounds it had


def test_engine_reads_the_maxima_once_and_again_after_a_load(monkeypatch, tmp_path):
    from train_engine_helpers import PolicyLoss, load_tiny, make_batch, make_tiny_checkpoint

    from rlloom.algorithms.losses import loss_normalizer
    from rlloom.config import TrainEngineConfig
    from rlloom.engines.train.native import NativeTrainEngine

    reads = []
    real = step_guard._group_maxima
    monkeypatch.setattr(step_guard, "_group_maxima", lambda *a, **k: reads.append(1) or real(*a, **k))
    engine = NativeTrainEngine(TrainEngineConfig(lr=1e-3), load_tiny(make_tiny_checkpoint(tmp_path / "m")))
    batch = make_batch(6, seed=4)
    norm = loss_normalizer(batch.response_mask(), "token-mean")
    groups = len(engine.optimizer.device_optim.param_groups)
    for _ in range(3):
        assert (
            engine.train_step(batch, PolicyLoss(batch, "token-mean"), loss_normalizer=norm)[
                "train/skipped_step"
            ]
            == 0
        )
    assert len(reads) == groups  # the first step only
    engine.save(str(tmp_path / "ckpt"))
    engine.load(str(tmp_path / "ckpt"))
    engine.train_step(batch, PolicyLoss(batch, "token-mean"), loss_normalizer=norm)
    assert len(reads) == 2 * groups
