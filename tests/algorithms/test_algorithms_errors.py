"""User errors: wrong shapes, NaN/inf inputs, bad masks and bad settings raise ValueError naming the argument."""

import pytest
import torch

from rlloom.algorithms import (
    aggregate_loss,
    cispo_loss,
    entropy_from_logits,
    entropy_from_logits_chunked,
    gae_advantages,
    grpo_advantages,
    gspo_loss,
    is_weights,
    keep_informative_groups,
    kl_estimate,
    masked_whiten,
    overlong_penalty,
    ppo_clip_loss,
    reinforce_pp_baseline_advantages,
    reinforce_pp_returns,
    rloo_advantages,
    value_loss,
)

B, T = 3, 4
X = lambda: torch.randn(B, T)
M = lambda: torch.ones(B, T, dtype=torch.bool)
R = lambda: torch.randn(B)
G = lambda: torch.tensor([0, 0, 1])

# (function, keyword arguments) of valid calls; the tests break one argument at a time
CALLS = {
    "grpo": (grpo_advantages, lambda: {"rewards_B": R(), "group_ids_B": G()}),
    "rloo": (rloo_advantages, lambda: {"rewards_B": R(), "group_ids_B": G()}),
    "rpp_returns": (reinforce_pp_returns, lambda: {"token_rewards_BT": X(), "mask_BT": M()}),
    "rpp_baseline": (
        reinforce_pp_baseline_advantages,
        lambda: {"rewards_B": R(), "group_ids_B": G(), "mask_BT": M()},
    ),
    "gae": (
        lambda **kw: gae_advantages(**kw, gamma=1.0, lam=0.95),
        lambda: {"token_rewards_BT": X(), "values_BT": X(), "mask_BT": M()},
    ),
    "whiten": (masked_whiten, lambda: {"x_BT": X(), "mask_BT": M()}),
    "ppo": (ppo_clip_loss, lambda: {"logp_BT": X(), "old_logp_BT": X(), "adv_BT": X(), "mask_BT": M()}),
    "gspo": (gspo_loss, lambda: {"logp_BT": X(), "old_logp_BT": X(), "adv_B": R(), "mask_BT": M()}),
    "cispo": (cispo_loss, lambda: {"logp_BT": X(), "old_logp_BT": X(), "adv_BT": X(), "mask_BT": M()}),
    "value": (
        lambda **kw: value_loss(**kw, clip=0.2),
        lambda: {"values_BT": X(), "old_values_BT": X(), "returns_BT": X(), "mask_BT": M()},
    ),
    "aggregate": (
        lambda **kw: aggregate_loss(**kw, mode="token-mean"),
        lambda: {"loss_BT": X(), "mask_BT": M()},
    ),
    "kl": (lambda **kw: kl_estimate(**kw, kind="k3"), lambda: {"logp_BT": X(), "ref_logp_BT": X()}),
    "is": (is_weights, lambda: {"old_logp_BT": X(), "rollout_logp_BT": X(), "mask_BT": M()}),
    "keep": (keep_informative_groups, lambda: {"rewards_B": R(), "group_ids_B": G()}),
}

FLOAT_ARGS = [
    (name, arg) for name, (_, kw) in CALLS.items() for arg, v in kw().items() if v.is_floating_point()
]
ALL_ARGS = [(name, arg) for name, (_, kw) in CALLS.items() for arg in kw()]


@pytest.mark.parametrize("name", sorted(CALLS))
def test_valid_call_runs(name):
    fn, kwargs = CALLS[name]
    fn(**kwargs())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("name,arg", FLOAT_ARGS)
def test_nan_or_inf_names_the_argument(name, arg, bad):
    fn, make = CALLS[name]
    kwargs = make()
    kwargs[arg] = kwargs[arg].clone()
    kwargs[arg].view(-1)[-1] = bad
    with pytest.raises(ValueError, match=f"{arg} has 1 NaN/inf"):
        fn(**kwargs)


@pytest.mark.parametrize("name,arg", ALL_ARGS)
def test_wrong_shape_names_the_argument(name, arg):
    fn, make = CALLS[name]
    kwargs = make()
    kwargs[arg] = torch.cat([kwargs[arg], kwargs[arg][:1]])  # one extra row
    with pytest.raises(ValueError, match=arg):
        fn(**kwargs)


def test_non_binary_mask_is_rejected():
    with pytest.raises(ValueError, match="mask_BT holds values other than 0 and 1"):
        ppo_clip_loss(X(), X(), X(), torch.full((B, T), 2))


def test_float_group_ids_are_rejected():
    with pytest.raises(ValueError, match="group_ids_B has dtype"):
        grpo_advantages(R(), torch.tensor([0.0, 0.0, 1.0]))


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: ppo_clip_loss(X(), X(), X(), M(), eps_low=1.5), "eps_low=1.5"),
        (lambda: ppo_clip_loss(X(), X(), X(), M(), eps_high=-0.1), "eps_high=-0.1"),
        (lambda: ppo_clip_loss(X(), X(), X(), M(), dual_clip_c=0.5), "dual_clip_c=0.5"),
        (lambda: value_loss(X(), X(), X(), M(), clip=0.0), "clip=0.0"),
        (lambda: reinforce_pp_returns(X(), M(), gamma=1.5), "gamma=1.5"),
        (lambda: gae_advantages(X(), X(), M(), gamma=1.0, lam=-1.0), "lam=-1.0"),
        (lambda: kl_estimate(X(), X(), "k4"), "k1, k2, k3, abs"),
        (lambda: is_weights(X(), X(), M(), level="batch"), "level='batch'"),
        (lambda: is_weights(X(), X(), M(), mode="clip"), "mode='clip'"),
        (lambda: is_weights(X(), X(), M(), low=3.0, high=2.0), "low=3.0"),
        (lambda: overlong_penalty(torch.tensor([1]), max_len=10, buffer_len=11, factor=1.0), "buffer_len=11"),
        (lambda: overlong_penalty(torch.tensor([-1]), max_len=10, buffer_len=2, factor=1.0), "lengths_B"),
        (lambda: aggregate_loss(X(), M(), "seq-mean-token-sum-norm", norm_constant=0), "norm_constant=0"),
        (lambda: entropy_from_logits_chunked(torch.randn(4, 5), 0), "chunk_size=0"),
        (lambda: entropy_from_logits(torch.tensor([[0.0, float("nan")]])), "logits_BTV has 1 NaN"),
        (
            lambda: entropy_from_logits_chunked(torch.tensor([[0.0, 1.0], [float("inf"), 0.0]]), 1),
            "logits_NV has 1 NaN",
        ),
        (lambda: ppo_clip_loss(X(), X(), torch.randn(T), M()), "adv_BT has shape"),
    ],
)
def test_bad_settings_raise(call, match):
    with pytest.raises(ValueError, match=match):
        call()
