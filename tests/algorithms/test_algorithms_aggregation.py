"""Loss aggregation: naive references per mode, padding invariance, and exact micro-batching (value and grads)."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlloom.algorithms import AGG_MODES, aggregate_loss, aggregate_loss_sum, loss_normalizer, ppo_clip_loss


@pytest.fixture
def gen():
    seed = random.randrange(2**31)
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)


def naive_aggregate(loss_BT, mask_BT, mode, norm_constant):
    rows = [
        [loss_BT[b, t].item() for t in range(loss_BT.shape[1]) if mask_BT[b, t]]
        for b in range(loss_BT.shape[0])
    ]
    valid_rows = [row for row in rows if row]
    tokens = [x for row in rows for x in row]
    if mode == "token-sum":
        return sum(tokens)
    if not tokens:
        return 0.0
    if mode == "token-mean":
        return sum(tokens) / len(tokens)
    if mode == "seq-mean-token-sum":
        return sum(sum(row) for row in valid_rows) / len(valid_rows)
    if mode == "seq-mean-token-mean":
        return sum(sum(row) / len(row) for row in valid_rows) / len(valid_rows)
    constant = norm_constant if norm_constant is not None else loss_BT.shape[1]
    return sum(tokens) / (len(valid_rows) * constant)


def random_batch(gen, rows, cols, *, empty_rows=True):
    loss_BT = torch.randn(rows, cols, generator=gen, dtype=torch.float64)
    mask_BT = torch.rand(rows, cols, generator=gen) < torch.rand(rows, 1, generator=gen)
    if empty_rows:
        mask_BT[torch.rand(rows, generator=gen) < 0.2] = False
    return loss_BT, mask_BT


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("rows,cols", [(1, 1), (3, 7), (12, 40)])
@pytest.mark.parametrize("norm_constant", [None, 64])
def test_aggregate_matches_naive(gen, mode, rows, cols, norm_constant):
    loss_BT, mask_BT = random_batch(gen, rows, cols)
    out = aggregate_loss(loss_BT, mask_BT, mode, norm_constant=norm_constant)
    assert out.dim() == 0
    assert out.item() == pytest.approx(
        naive_aggregate(loss_BT, mask_BT, mode, norm_constant), rel=1e-12, abs=1e-12
    )


@pytest.mark.parametrize("mode", AGG_MODES)
def test_all_masked_batch_gives_zero_not_nan(mode):
    loss_BT = torch.randn(3, 5, requires_grad=True)
    out = aggregate_loss(loss_BT, torch.zeros(3, 5, dtype=torch.bool), mode)
    out.backward()
    assert out.item() == 0.0 and torch.equal(loss_BT.grad, torch.zeros(3, 5))
    assert loss_normalizer(torch.zeros(3, 5), mode) >= 1


def test_normalizer_values():
    mask_BT = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    expected = {"token-mean": 3, "token-sum": 1, "seq-mean-token-sum": 2, "seq-mean-token-mean": 2}
    for mode, value in expected.items():
        assert loss_normalizer(mask_BT, mode) == value
    assert loss_normalizer(mask_BT, "seq-mean-token-sum-norm") == 2 * 3
    assert loss_normalizer(mask_BT, "seq-mean-token-sum-norm", norm_constant=100) == 200


def test_unknown_mode_lists_valid_modes():
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm"):
        aggregate_loss(torch.zeros(1, 1), torch.ones(1, 1), "mean")
    with pytest.raises(ValueError, match="token-mean"):
        loss_normalizer(torch.ones(1, 1), "sum")


@settings(max_examples=50, deadline=None, database=None)
@given(
    mode=st.sampled_from(AGG_MODES),
    rows=st.integers(1, 8),
    cols=st.integers(1, 12),
    pad=st.integers(1, 6),
    seed=st.integers(0, 2**31 - 1),
)
def test_padding_columns_do_not_change_aggregate(mode, rows, cols, pad, seed):
    gen = torch.Generator().manual_seed(seed)
    loss_BT, mask_BT = random_batch(gen, rows, cols)
    padded_loss = torch.cat(
        [loss_BT, 1e3 * torch.randn(rows, pad, generator=gen, dtype=torch.float64)], dim=1
    )
    padded_mask = torch.cat([mask_BT, torch.zeros(rows, pad, dtype=torch.bool)], dim=1)
    # the default norm_constant of the -norm mode is T itself, so give it a fixed one here
    norm_constant = 16 if mode == "seq-mean-token-sum-norm" else None
    torch.testing.assert_close(
        aggregate_loss(padded_loss, padded_mask, mode, norm_constant=norm_constant),
        aggregate_loss(loss_BT, mask_BT, mode, norm_constant=norm_constant),
        rtol=1e-12,
        atol=1e-12,
    )


def micro_batched(fn, x_BT, mask_BT, mode, slices, norm_constant):
    normalizer = loss_normalizer(mask_BT, mode, norm_constant=norm_constant)
    return sum(aggregate_loss_sum(fn(x_BT[idx], idx), mask_BT[idx], mode) for idx in slices) / normalizer


@settings(max_examples=50, deadline=None, database=None)
@given(
    mode=st.sampled_from(AGG_MODES),
    rows=st.integers(1, 10),
    cols=st.integers(1, 12),
    num_slices=st.integers(1, 10),
    use_default_norm=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_micro_batches_reproduce_whole_batch_value_and_gradients(
    mode, rows, cols, num_slices, use_default_norm, seed
):
    """The training engine's contract: sum of slice numerators / global normalizer == whole-batch loss."""
    gen = torch.Generator().manual_seed(seed)
    _, mask_BT = random_batch(gen, rows, cols)
    logp_BT = (-torch.rand(rows, cols, generator=gen, dtype=torch.float64)).requires_grad_()
    old_logp_BT = logp_BT.detach() + 0.3 * torch.randn(rows, cols, generator=gen, dtype=torch.float64)
    adv_B = torch.randn(rows, generator=gen, dtype=torch.float64)

    def per_token_loss(logp_slice, idx):
        return ppo_clip_loss(logp_slice, old_logp_BT[idx], adv_B[idx], mask_BT[idx], eps_high=0.28)[0]

    order = torch.randperm(rows, generator=gen)
    cuts = (
        sorted(random.Random(seed).sample(range(1, rows), min(num_slices - 1, rows - 1))) if rows > 1 else []
    )
    slices = [chunk for chunk in torch.tensor_split(order, cuts) if chunk.numel()]
    norm_constant = None if use_default_norm else 7.0
    whole = aggregate_loss(
        per_token_loss(logp_BT, torch.arange(rows)), mask_BT, mode, norm_constant=norm_constant
    )
    split = micro_batched(per_token_loss, logp_BT, mask_BT, mode, slices, norm_constant)
    torch.testing.assert_close(split, whole, rtol=1e-12, atol=1e-14)
    (grad_whole,) = torch.autograd.grad(whole, logp_BT)
    (grad_split,) = torch.autograd.grad(split, logp_BT)
    torch.testing.assert_close(grad_split, grad_whole, rtol=1e-12, atol=1e-14)
