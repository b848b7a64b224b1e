"""IS weights (TIS/MIS, token/sequence) and DAPO filters against naive loop references."""

import math
import random

import pytest
import torch

from rlloom.algorithms import is_weights, keep_informative_groups, overlong_penalty


@pytest.fixture
def gen():
    seed = random.randrange(2**31)
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)


def naive_is(old, rollout, mask, level, mode, low, high):
    B, T = old.shape
    weights = torch.zeros(B, T, dtype=torch.float64)
    outside = diffs = 0
    valid = [(b, t) for b in range(B) for t in range(T) if mask[b, t]]
    for b in range(B):
        seq_log_ratio = sum(old[b, t].item() - rollout[b, t].item() for t in range(T) if mask[b, t])
        for t in range(T):
            if not mask[b, t]:
                continue
            log_ratio = old[b, t].item() - rollout[b, t].item() if level == "token" else seq_log_ratio
            ratio = math.exp(min(max(log_ratio, -20.0), 20.0))
            is_out = ratio > high or ratio < (low or 0.0)
            if mode == "truncate":
                w = min(ratio, high) if low is None else max(min(ratio, high), low)
            else:
                w = 0.0 if is_out else ratio
            weights[b, t] = w
            outside += is_out
            diffs += abs(old[b, t].item() - rollout[b, t].item())
    n = max(len(valid), 1)
    return weights, sum(weights[b, t].item() for b, t in valid) / n, outside / n, diffs / n


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize(
    "mode,low,high",
    [("truncate", None, 2.0), ("truncate", 0.5, 1.5), ("mask", None, 2.0), ("mask", 0.5, 2.0)],
)
@pytest.mark.parametrize("shape", [(1, 1), (6, 9), (12, 30)])
def test_is_weights_match_naive(gen, level, mode, low, high, shape):
    old_logp_BT = -2 * torch.rand(shape, generator=gen, dtype=torch.float64)
    scale = 0.6 if level == "token" else 0.15
    rollout_logp_BT = old_logp_BT + scale * torch.randn(shape, generator=gen, dtype=torch.float64)
    mask_BT = torch.rand(shape, generator=gen) < 0.7
    old_logp_BT.requires_grad_()
    weights_BT, metrics = is_weights(
        old_logp_BT, rollout_logp_BT, mask_BT, level=level, mode=mode, low=low, high=high
    )
    ref_w, ref_mean, ref_frac, ref_diff = naive_is(
        old_logp_BT.detach(), rollout_logp_BT, mask_BT, level, mode, low, high
    )
    assert not weights_BT.requires_grad
    torch.testing.assert_close(weights_BT, ref_w, rtol=1e-9, atol=1e-12)
    frac_key = "is/frac_truncated" if mode == "truncate" else "is/frac_masked"
    assert set(metrics) == {"is/weight_mean", frac_key, "is/mean_abs_logp_diff"}
    assert metrics["is/weight_mean"].item() == pytest.approx(ref_mean, rel=1e-6)
    assert metrics[frac_key].item() == pytest.approx(ref_frac, rel=1e-6)
    assert metrics["is/mean_abs_logp_diff"].item() == pytest.approx(ref_diff, rel=1e-6)


def test_sequence_level_clamps_huge_log_ratio():
    weights_BT, _ = is_weights(
        torch.zeros(1, 100),
        torch.full((1, 100), -5.0),
        torch.ones(1, 100),
        level="sequence",
        mode="mask",
        high=1e30,
    )
    assert torch.allclose(weights_BT, torch.full((1, 100), math.exp(20.0)))


@pytest.mark.parametrize("num_samples,num_groups", [(1, 1), (8, 2), (30, 7)])
def test_keep_informative_groups_matches_naive(gen, num_samples, num_groups):
    rewards_B = torch.randint(0, 2, (num_samples,), generator=gen).double()
    group_ids_B = torch.randint(0, num_groups, (num_samples,), generator=gen)
    keep_B = keep_informative_groups(rewards_B, group_ids_B)
    r, g = rewards_B.tolist(), group_ids_B.tolist()
    expected = [len({r[j] for j in range(num_samples) if g[j] == g[i]}) > 1 for i in range(num_samples)]
    assert keep_B.dtype == torch.bool and keep_B.tolist() == expected


def test_keep_informative_groups_example():
    keep_B = keep_informative_groups(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5]), torch.tensor([3, 3, 5, 5, 9]))
    assert keep_B.tolist() == [False, False, True, True, False]


@pytest.mark.parametrize(
    "max_len,buffer_len,factor", [(20, 5, 1.0), (20, 20, 0.5), (10, 1, 2.0), (10, 0, 1.0)]
)
def test_overlong_penalty_matches_naive(max_len, buffer_len, factor):
    lengths_B = torch.arange(0, max_len + 5)
    penalty_B = overlong_penalty(lengths_B, max_len=max_len, buffer_len=buffer_len, factor=factor)
    expected = []
    for length in lengths_B.tolist():
        if buffer_len == 0 or length <= max_len - buffer_len:
            expected.append(0.0)
        elif length <= max_len:
            expected.append(((max_len - buffer_len) - length) / buffer_len * factor)
        else:
            expected.append(-factor)
    torch.testing.assert_close(penalty_B, torch.tensor(expected), rtol=1e-6, atol=1e-7)
