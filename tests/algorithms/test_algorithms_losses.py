"""Policy and value losses against naive per-token references (values, gradients, metrics) and masking properties."""

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlloom.algorithms import aggregate_loss_sum, cispo_loss, gspo_loss, ppo_clip_loss, value_loss


@pytest.fixture
def gen():
    seed = random.randrange(2**31)
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)


def policy_inputs(gen, shape, *, noise=0.3, adv_per_token=True):
    old_logp_BT = -torch.rand(shape, generator=gen, dtype=torch.float64) * 3
    logp_BT = (old_logp_BT + noise * torch.randn(shape, generator=gen, dtype=torch.float64)).requires_grad_()
    adv_shape = shape if adv_per_token else shape[:1]
    adv = torch.randn(adv_shape, generator=gen, dtype=torch.float64)
    mask_BT = torch.rand(shape, generator=gen) < 0.75
    if shape[0] > 1:
        mask_BT[-1] = False
    return logp_BT, old_logp_BT, adv, mask_BT


def naive_ppo(logp_BT, old_logp_BT, adv_BT, mask_BT, eps_low, eps_high, dual_c):
    """Per-token loss, d loss / d logp and metric indicators, with Python floats."""
    loss, grad = torch.zeros_like(old_logp_BT), torch.zeros_like(old_logp_BT)
    low = high = dual = 0
    kl, ratios = [], []
    for b in range(logp_BT.shape[0]):
        for t in range(logp_BT.shape[1]):
            if not mask_BT[b, t]:
                continue
            a, lr = adv_BT[b, t].item(), logp_BT[b, t].item() - old_logp_BT[b, t].item()
            r = math.exp(lr)
            clipped_r = min(max(r, 1 - eps_low), 1 + eps_high)
            value, g = (-a * r, -a * r) if -a * r >= -a * clipped_r else (-a * clipped_r, 0.0)
            if dual_c is not None and a < 0 and value > -dual_c * a:
                value, g, dual = -dual_c * a, 0.0, dual + 1
            loss[b, t], grad[b, t] = value, g
            low += r < 1 - eps_low and a < 0
            high += r > 1 + eps_high and a > 0
            kl.append(r - 1 - lr)
            ratios.append(r)
    n = max(len(ratios), 1)
    metrics = {
        "loss/clipfrac_low": low / n,
        "loss/clipfrac_high": high / n,
        "loss/dual_clipfrac": dual / n,
        "loss/approx_kl": sum(kl) / n,
        "loss/ratio_mean": sum(ratios) / n,
    }
    return loss, grad, metrics


def check_metrics(metrics, expected):
    assert set(metrics) == set(expected)
    for key, value in expected.items():
        assert not metrics[key].requires_grad and metrics[key].dim() == 0
        assert metrics[key].item() == pytest.approx(value, rel=1e-6, abs=1e-9), key


@pytest.mark.parametrize("shape", [(1, 1), (4, 9), (16, 33)])
@pytest.mark.parametrize("eps_low,eps_high,dual_c", [(0.2, 0.2, None), (0.2, 0.28, None), (0.1, 0.3, 3.0)])
@pytest.mark.parametrize("adv_per_token", [True, False])
def test_ppo_clip_matches_naive(gen, shape, eps_low, eps_high, dual_c, adv_per_token):
    logp_BT, old_logp_BT, adv, mask_BT = policy_inputs(gen, shape, noise=0.8, adv_per_token=adv_per_token)
    loss_BT, metrics = ppo_clip_loss(
        logp_BT, old_logp_BT, adv, mask_BT.int(), eps_low=eps_low, eps_high=eps_high, dual_clip_c=dual_c
    )
    adv_BT = adv if adv_per_token else adv[:, None].expand(shape)
    ref_loss, ref_grad, ref_metrics = naive_ppo(
        logp_BT, old_logp_BT, adv_BT, mask_BT, eps_low, eps_high, dual_c
    )
    torch.testing.assert_close(loss_BT.detach(), ref_loss, rtol=1e-9, atol=1e-12)
    (grad_BT,) = torch.autograd.grad(loss_BT.sum(), logp_BT)
    torch.testing.assert_close(grad_BT, ref_grad, rtol=1e-9, atol=1e-12)
    check_metrics(metrics, ref_metrics)


def test_ppo_dual_clip_caps_negative_advantage_loss():
    loss_BT, metrics = ppo_clip_loss(
        torch.tensor([[2.0, 2.0]]),
        torch.zeros(1, 2),
        torch.tensor([[-1.0, 1.0]]),
        torch.ones(1, 2),
        dual_clip_c=3.0,
    )
    # r = e^2 ~ 7.39: A < 0 is capped at 3 * |A|; A > 0 is clipped at -(1.2)
    torch.testing.assert_close(loss_BT, torch.tensor([[3.0, -1.2]]))
    assert metrics["loss/dual_clipfrac"].item() == 0.5


def gspo_reference_objective(logp_BT, old_logp_BT, adv_B, mask_BT, eps_low, eps_high):
    """Sequence-level GSPO written directly: sum_i max(-A_i s_i, -A_i clip(s_i)), s_i differentiable."""
    total = 0.0 * logp_BT.sum()  # keeps the graph when every row is masked
    for b in range(logp_BT.shape[0]):
        valid = mask_BT[b]
        if not valid.any():
            continue
        s = torch.exp((logp_BT[b][valid] - old_logp_BT[b][valid]).mean())
        a = adv_B[b]
        total = total + torch.maximum(-a * s, -a * s.clamp(1 - eps_low, 1 + eps_high))
    return total


@pytest.mark.parametrize("shape", [(1, 1), (6, 7), (20, 25)])
@pytest.mark.parametrize("eps_low,eps_high", [(3e-4, 4e-4), (0.05, 0.08)])
def test_gspo_token_form_has_gspo_value_and_gradient(gen, shape, eps_low, eps_high):
    logp_BT, old_logp_BT, adv_B, mask_BT = policy_inputs(gen, shape, noise=0.1, adv_per_token=False)
    loss_BT, metrics = gspo_loss(logp_BT, old_logp_BT, adv_B, mask_BT, eps_low=eps_low, eps_high=eps_high)
    ours = aggregate_loss_sum(loss_BT, mask_BT, "seq-mean-token-mean")
    ref = gspo_reference_objective(logp_BT, old_logp_BT, adv_B, mask_BT, eps_low, eps_high)
    torch.testing.assert_close(ours, ref, rtol=1e-9, atol=1e-12)
    (grad_ours,) = torch.autograd.grad(ours, logp_BT)
    (grad_ref,) = torch.autograd.grad(ref, logp_BT)
    torch.testing.assert_close(grad_ours, grad_ref, rtol=1e-9, atol=1e-12)
    seq_ratio_B = torch.stack(
        [
            torch.exp((logp_BT[b] - old_logp_BT[b])[mask_BT[b]].mean())
            if mask_BT[b].any()
            else logp_BT.new_ones(())
            for b in range(shape[0])
        ]
    ).detach()
    clipped_high = [(seq_ratio_B[b] > 1 + eps_high) & (adv_B[b] > 0) for b in range(shape[0])]
    expected_high = sum(int(clipped_high[b]) * int(mask_BT[b].sum()) for b in range(shape[0])) / max(
        int(mask_BT.sum()), 1
    )
    assert metrics["loss/clipfrac_high"].item() == pytest.approx(expected_high)


@pytest.mark.parametrize("adv", [-1.0, 1.0])
def test_gspo_clamps_the_sequence_log_ratio_with_zero_gradient(adv):
    # A sequence log-ratio of 12 is above the ceiling of 10: the ratio is e^10 and no gradient flows
    # (without the clamp a negative advantage gives ~e^12 / T ~ 7e3 per token).
    T = 23
    old_logp_BT = torch.full((1, T), -14.0, dtype=torch.float64)
    logp_BT = torch.full((1, T), -2.0, dtype=torch.float64, requires_grad=True)
    mask_BT = torch.ones(1, T, dtype=torch.bool)
    adv_B = torch.tensor([adv], dtype=torch.float64)
    loss_BT, metrics = gspo_loss(logp_BT, old_logp_BT, adv_B, mask_BT, eps_low=0.2, eps_high=0.2)
    (grad,) = torch.autograd.grad(aggregate_loss_sum(loss_BT, mask_BT, "seq-mean-token-mean"), logp_BT)
    assert grad.abs().max().item() == 0.0
    assert metrics["loss/ratio_mean"].item() == pytest.approx(math.exp(10.0))
    if adv < 0:
        assert loss_BT[0, 0].item() == pytest.approx(math.exp(10.0))
    # Below the ceiling the gradient is GSPO's: s_i * A-weighted, nonzero.
    loss_BT, _ = gspo_loss(
        logp_BT, old_logp_BT, adv_B, mask_BT, eps_low=0.2, eps_high=0.2, max_log_ratio=13.0
    )
    (grad,) = torch.autograd.grad(aggregate_loss_sum(loss_BT, mask_BT, "seq-mean-token-mean"), logp_BT)
    expected = 0.0 if adv > 0 else math.exp(12.0) / T  # adv > 0: the upper clip zeroes it
    assert grad.abs().max().item() == pytest.approx(expected)


@pytest.mark.parametrize("max_log_ratio", [0.0, -1.0, 21.0, float("nan")])
def test_gspo_rejects_a_bad_ceiling(max_log_ratio):
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="max_log_ratio"):
        gspo_loss(x, x, torch.ones(1), torch.ones(1, 2, dtype=torch.bool), max_log_ratio=max_log_ratio)


@pytest.mark.parametrize("shape", [(1, 1), (5, 11), (16, 30)])
@pytest.mark.parametrize("eps_low,eps_high", [(None, 0.28), (0.2, 0.2), (None, 3.0)])
def test_cispo_matches_naive(gen, shape, eps_low, eps_high):
    logp_BT, old_logp_BT, adv_BT, mask_BT = policy_inputs(gen, shape, noise=0.5)
    loss_BT, metrics = cispo_loss(logp_BT, old_logp_BT, adv_BT, mask_BT, eps_low=eps_low, eps_high=eps_high)
    ref_loss, ref_grad = torch.zeros_like(old_logp_BT), torch.zeros_like(old_logp_BT)
    num_low = num_high = 0
    for b in range(shape[0]):
        for t in range(shape[1]):
            if mask_BT[b, t]:
                r = math.exp(logp_BT[b, t].item() - old_logp_BT[b, t].item())
                w = min(r, 1 + eps_high) if eps_low is None else min(max(r, 1 - eps_low), 1 + eps_high)
                num_low += eps_low is not None and r < 1 - eps_low
                num_high += r > 1 + eps_high
                ref_loss[b, t] = -w * adv_BT[b, t].item() * logp_BT[b, t].item()
                ref_grad[b, t] = -w * adv_BT[b, t].item()
    torch.testing.assert_close(loss_BT.detach(), ref_loss, rtol=1e-9, atol=1e-12)
    (grad_BT,) = torch.autograd.grad(loss_BT.sum(), logp_BT)
    torch.testing.assert_close(grad_BT, ref_grad, rtol=1e-9, atol=1e-12)
    n = max(int(mask_BT.sum()), 1)
    assert metrics["loss/clipfrac_high"].item() == pytest.approx(num_high / n)
    assert metrics["loss/clipfrac_low"].item() == pytest.approx(num_low / n)


@pytest.mark.parametrize("shape", [(1, 1), (7, 13)])
@pytest.mark.parametrize("clip", [0.1, 10.0])
def test_value_loss_matches_naive(gen, shape, clip):
    values_BT = torch.randn(shape, generator=gen, dtype=torch.float64)
    old_values_BT = values_BT + 0.3 * torch.randn(shape, generator=gen, dtype=torch.float64)
    returns_BT = torch.randn(shape, generator=gen, dtype=torch.float64)
    mask_BT = torch.rand(shape, generator=gen) < 0.7
    loss_BT = value_loss(values_BT, old_values_BT, returns_BT, mask_BT, clip=clip)
    ref = torch.zeros_like(values_BT)
    for b in range(shape[0]):
        for t in range(shape[1]):
            if mask_BT[b, t]:
                v, old, ret = values_BT[b, t].item(), old_values_BT[b, t].item(), returns_BT[b, t].item()
                clipped = min(max(v, old - clip), old + clip)
                ref[b, t] = 0.5 * max((v - ret) ** 2, (clipped - ret) ** 2)
    torch.testing.assert_close(loss_BT, ref, rtol=1e-9, atol=1e-12)


LOSSES = {
    "ppo": lambda lp, old, adv, m: ppo_clip_loss(lp, old, adv, m, eps_high=0.28, dual_clip_c=3.0),
    "gspo": lambda lp, old, adv, m: gspo_loss(lp, old, adv[:, 0], m, eps_low=0.05, eps_high=0.05),
    "cispo": lambda lp, old, adv, m: cispo_loss(lp, old, adv, m),
}


@settings(max_examples=50, deadline=None, database=None)
@given(
    name=st.sampled_from(sorted(LOSSES)),
    rows=st.integers(1, 6),
    cols=st.integers(1, 10),
    seed=st.integers(0, 2**31 - 1),
)
def test_losses_ignore_masked_tokens(name, rows, cols, seed):
    gen = torch.Generator().manual_seed(seed)
    logp_BT, old_logp_BT, adv_BT, mask_BT = policy_inputs(gen, (rows, cols))
    adv_BT = adv_BT[:, :1].expand(rows, cols).clone()  # sequence-level so GSPO sees the same advantage
    noise = lambda: 5 * torch.randn((rows, cols), generator=gen, dtype=torch.float64)
    logp2_BT = torch.where(mask_BT, logp_BT.detach(), noise()).requires_grad_()
    old2_BT = torch.where(mask_BT, old_logp_BT, noise())
    adv2_BT = torch.where(mask_BT, adv_BT, noise()) if name != "gspo" else adv_BT
    loss_BT, metrics = LOSSES[name](logp_BT, old_logp_BT, adv_BT, mask_BT)
    loss2_BT, metrics2 = LOSSES[name](logp2_BT, old2_BT, adv2_BT, mask_BT)
    torch.testing.assert_close(loss_BT, loss2_BT, rtol=1e-12, atol=0)
    assert torch.all(loss_BT[~mask_BT] == 0)
    weights_BT = torch.randn((rows, cols), generator=gen, dtype=torch.float64)
    (grad,) = torch.autograd.grad((loss_BT * weights_BT).sum(), logp_BT)
    (grad2,) = torch.autograd.grad((loss2_BT * weights_BT).sum(), logp2_BT)
    torch.testing.assert_close(grad, grad2, rtol=1e-12, atol=0)
    assert torch.all(grad2[~mask_BT] == 0)
    for key in metrics:
        torch.testing.assert_close(metrics[key], metrics2[key], rtol=1e-12, atol=1e-15)


def test_losses_do_not_mutate_inputs(gen):
    logp_BT, old_logp_BT, adv_BT, mask_BT = policy_inputs(gen, (4, 6))
    copies = [x.detach().clone() for x in (logp_BT, old_logp_BT, adv_BT, mask_BT)]
    for fn in LOSSES.values():
        fn(logp_BT, old_logp_BT, adv_BT, mask_BT)[0].sum().backward()
    for x, copy in zip((logp_BT, old_logp_BT, adv_BT, mask_BT), copies):
        assert torch.equal(x.detach(), copy)


def test_huge_log_ratio_stays_finite():
    loss_BT, metrics = ppo_clip_loss(
        torch.tensor([[0.0]]), torch.tensor([[-500.0]]), torch.tensor([-1.0]), torch.ones(1, 1)
    )
    assert torch.isfinite(loss_BT).all() and all(torch.isfinite(v) for v in metrics.values())
