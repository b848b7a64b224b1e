"""Advantage estimators against naive per-sample / per-token loop references on fresh random inputs."""

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlloom.algorithms import (
    gae_advantages,
    grpo_advantages,
    masked_whiten,
    reinforce_pp_baseline_advantages,
    reinforce_pp_returns,
    rloo_advantages,
)


@pytest.fixture
def gen():
    seed = random.randrange(2**31)
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)


def random_groups(gen, num_samples, num_groups, *, ties):
    group_ids_B = torch.randint(0, num_groups, (num_samples,), generator=gen) * 7 - 3  # arbitrary ids
    if ties:  # discrete rewards: ties and all-equal groups are common
        rewards_B = torch.randint(0, 2, (num_samples,), generator=gen).to(torch.float64)
    else:
        rewards_B = torch.randn(num_samples, generator=gen, dtype=torch.float64)
    return rewards_B, group_ids_B


def random_mask(gen, shape, *, empty_rows=True):
    mask_BT = torch.rand(shape, generator=gen) < 0.7
    if empty_rows and shape[0] > 1:
        mask_BT[0] = False
    return mask_BT


def naive_group_members(group_ids_B, i):
    return [j for j in range(len(group_ids_B)) if group_ids_B[j] == group_ids_B[i]]


def naive_grpo(rewards_B, group_ids_B, scale_by_std, eps):
    r, g = rewards_B.tolist(), group_ids_B.tolist()
    out = []
    for i in range(len(r)):
        members = [r[j] for j in naive_group_members(g, i)]
        if len(members) == 1:
            out.append(0.0)
            continue
        mean = sum(members) / len(members)
        std = math.sqrt(sum((x - mean) ** 2 for x in members) / (len(members) - 1))
        out.append((r[i] - mean) / (std + eps) if scale_by_std else r[i] - mean)
    return torch.tensor(out, dtype=torch.float64)


def naive_rloo(rewards_B, group_ids_B):
    r, g = rewards_B.tolist(), group_ids_B.tolist()
    out = []
    for i in range(len(r)):
        others = [r[j] for j in naive_group_members(g, i) if j != i]
        out.append(r[i] - sum(others) / len(others) if others else 0.0)
    return torch.tensor(out, dtype=torch.float64)


def compacted(row, mask_row):
    """Indices and values of the valid positions of one row: skip semantics = compaction."""
    idx = [t for t in range(len(mask_row)) if mask_row[t]]
    return idx, [row[t] for t in idx]


def naive_returns(token_rewards_BT, mask_BT, gamma):
    out = torch.zeros_like(token_rewards_BT)
    for b in range(token_rewards_BT.shape[0]):
        idx, rewards = compacted(token_rewards_BT[b].tolist(), mask_BT[b].tolist())
        running = 0.0
        for k in reversed(range(len(idx))):
            running = rewards[k] + gamma * running
            out[b, idx[k]] = running
    return out


def naive_gae(token_rewards_BT, values_BT, mask_BT, gamma, lam):
    adv, ret = torch.zeros_like(values_BT), torch.zeros_like(values_BT)
    for b in range(values_BT.shape[0]):
        idx, rewards = compacted(token_rewards_BT[b].tolist(), mask_BT[b].tolist())
        _, values = compacted(values_BT[b].tolist(), mask_BT[b].tolist())
        last = 0.0
        for k in reversed(range(len(idx))):
            next_value = values[k + 1] if k + 1 < len(idx) else 0.0
            last = rewards[k] + gamma * next_value - values[k] + gamma * lam * last
            adv[b, idx[k]] = last
            ret[b, idx[k]] = last + values[k]
    return adv, ret


def naive_whiten(x_BT, mask_BT, shift_mean, eps):
    valid = [x_BT[b, t].item() for b in range(x_BT.shape[0]) for t in range(x_BT.shape[1]) if mask_BT[b, t]]
    out = torch.zeros_like(x_BT)
    if not valid:
        return out
    mean = sum(valid) / len(valid)
    var = sum((v - mean) ** 2 for v in valid) / max(len(valid) - 1, 1)
    for b in range(x_BT.shape[0]):
        for t in range(x_BT.shape[1]):
            if mask_BT[b, t]:
                w = (x_BT[b, t].item() - mean) / math.sqrt(var + eps)
                out[b, t] = w if shift_mean else w + mean
    return out


@pytest.mark.parametrize("num_samples,num_groups", [(1, 1), (6, 2), (17, 5), (40, 8)])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("scale_by_std", [True, False])
def test_grpo_matches_naive(gen, num_samples, num_groups, ties, scale_by_std):
    rewards_B, group_ids_B = random_groups(gen, num_samples, num_groups, ties=ties)
    before = rewards_B.clone()
    adv_B = grpo_advantages(rewards_B, group_ids_B, scale_by_std=scale_by_std, eps=1e-6)
    torch.testing.assert_close(
        adv_B, naive_grpo(rewards_B, group_ids_B, scale_by_std, 1e-6), rtol=1e-9, atol=1e-9
    )
    assert torch.equal(rewards_B, before)


def test_grpo_all_equal_group_and_singleton_get_zero():
    adv_B = grpo_advantages(torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 5.0]), torch.tensor([0, 0, 0, 1, 1, 2]))
    assert adv_B[:3].tolist() == [0.0, 0.0, 0.0] and adv_B[5].item() == 0.0
    assert adv_B[3] < 0 < adv_B[4]


@pytest.mark.parametrize("num_samples,num_groups", [(1, 1), (6, 2), (25, 6)])
@pytest.mark.parametrize("ties", [False, True])
def test_rloo_matches_naive(gen, num_samples, num_groups, ties):
    rewards_B, group_ids_B = random_groups(gen, num_samples, num_groups, ties=ties)
    adv_B = rloo_advantages(rewards_B, group_ids_B)
    torch.testing.assert_close(adv_B, naive_rloo(rewards_B, group_ids_B), rtol=1e-9, atol=1e-9)


@settings(max_examples=50, deadline=None, database=None)
@given(
    rewards=st.lists(st.floats(-100, 100, allow_nan=False), min_size=2, max_size=30),
    seed=st.integers(0, 2**31 - 1),
    scale_by_std=st.booleans(),
)
def test_grpo_and_rloo_sum_to_zero_in_every_group(rewards, seed, scale_by_std):
    gen = torch.Generator().manual_seed(seed)
    rewards_B = torch.tensor(rewards, dtype=torch.float64)
    group_ids_B = torch.randint(0, max(1, len(rewards) // 3), (len(rewards),), generator=gen)
    for adv_B in (
        grpo_advantages(rewards_B, group_ids_B, scale_by_std=scale_by_std),
        rloo_advantages(rewards_B, group_ids_B),
    ):
        for g in group_ids_B.unique():
            members = group_ids_B == g
            if members.sum() >= 2:
                assert abs(adv_B[members].sum().item()) < 1e-6 * (1 + rewards_B.abs().max().item())


@pytest.mark.parametrize("shape", [(1, 1), (3, 9), (8, 33)])
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_returns_matches_naive(gen, shape, gamma):
    token_rewards_BT = torch.randn(shape, generator=gen, dtype=torch.float64)
    mask_BT = random_mask(gen, shape)
    returns_BT = reinforce_pp_returns(token_rewards_BT, mask_BT.int(), gamma=gamma)
    torch.testing.assert_close(
        returns_BT, naive_returns(token_rewards_BT, mask_BT, gamma), rtol=1e-9, atol=1e-9
    )


def test_reinforce_pp_returns_pass_over_tool_output():
    # tokens 2..3 are tool output: their reward is ignored and they take no discount step
    returns = reinforce_pp_returns(
        torch.tensor([[0.0, 0.0, 9.0, 9.0, 1.0]]), torch.tensor([[1, 1, 0, 0, 1]]), gamma=0.5
    )
    assert returns.tolist() == [[0.25, 0.5, 0.0, 0.0, 1.0]]


@pytest.mark.parametrize("shape,num_groups", [((2, 5), 1), ((12, 7), 3), ((30, 20), 6)])
def test_reinforce_pp_baseline_matches_naive(gen, shape, num_groups):
    rewards_B, group_ids_B = random_groups(gen, shape[0], num_groups, ties=True)
    mask_BT = random_mask(gen, shape)
    adv_BT = reinforce_pp_baseline_advantages(rewards_B, group_ids_B, mask_BT)
    r, g = rewards_B.tolist(), group_ids_B.tolist()
    centered = [
        r[i] - sum(r[j] for j in naive_group_members(g, i)) / len(naive_group_members(g, i))
        for i in range(len(r))
    ]
    scores_BT = torch.tensor(centered, dtype=torch.float64)[:, None].repeat(1, shape[1])
    torch.testing.assert_close(adv_BT, naive_whiten(scores_BT, mask_BT, True, 1e-8), rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("shape", [(1, 1), (4, 10), (9, 31)])
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.8, 0.0)])
def test_gae_matches_naive(gen, shape, gamma, lam):
    token_rewards_BT = torch.randn(shape, generator=gen, dtype=torch.float64)
    values_BT = torch.randn(shape, generator=gen, dtype=torch.float64)
    mask_BT = random_mask(gen, shape)
    adv_BT, returns_BT = gae_advantages(token_rewards_BT, values_BT, mask_BT, gamma=gamma, lam=lam)
    ref_adv, ref_ret = naive_gae(token_rewards_BT, values_BT, mask_BT, gamma, lam)
    torch.testing.assert_close(adv_BT, ref_adv, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(returns_BT, ref_ret, rtol=1e-9, atol=1e-9)


def test_gae_lam_one_is_return_minus_value(gen):
    token_rewards_BT = torch.randn(3, 12, generator=gen, dtype=torch.float64)
    values_BT = torch.randn(3, 12, generator=gen, dtype=torch.float64)
    mask_BT = random_mask(gen, (3, 12))
    adv_BT, _ = gae_advantages(token_rewards_BT, values_BT, mask_BT, gamma=0.9, lam=1.0)
    expected = reinforce_pp_returns(token_rewards_BT, mask_BT, gamma=0.9) - values_BT * mask_BT
    torch.testing.assert_close(adv_BT, expected, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("shape", [(1, 1), (1, 2), (5, 8), (16, 40)])
@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_whiten_matches_naive(gen, shape, shift_mean):
    x_BT = 3 + 2 * torch.randn(shape, generator=gen, dtype=torch.float64)
    mask_BT = random_mask(gen, shape, empty_rows=False)
    out = masked_whiten(x_BT, mask_BT, shift_mean=shift_mean)
    torch.testing.assert_close(out, naive_whiten(x_BT, mask_BT, shift_mean, 1e-8), rtol=1e-9, atol=1e-9)


def test_masked_whiten_all_masked_is_zero():
    assert torch.equal(masked_whiten(torch.randn(3, 4), torch.zeros(3, 4)), torch.zeros(3, 4))
