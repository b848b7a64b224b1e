"""get_reward_fn: built-ins, weighted sums, and the plug-in contract for dotted paths."""

import math
import pickle

import pytest

from rlloom.rewards import BUILTIN_REWARDS, RewardRunner, WeightedReward, get_reward_fn
from rlloom.rewards.format import format_answer, format_boxed, format_number
from rlloom.rewards.numbers import number_match


def test_builtin_names_resolve_to_functions_with_the_reward_signature():
    for name, fn in BUILTIN_REWARDS.items():
        assert get_reward_fn(name) is fn
        truth = '{"numbers": [1, 2], "target": 3}' if name == "countdown" else "3"
        assert isinstance(fn("1 + 2 = 3", truth), float)


def test_weighted_sum_and_pickling():
    fn = get_reward_fn("number + 0.1*format_number")
    assert fn == WeightedReward(((number_match, 1.0), (format_number, 0.1)))
    assert math.isclose(fn("47", "47"), 1.1) and math.isclose(fn("it is 47", "47"), 1.0)
    assert pickle.loads(pickle.dumps(fn)) == fn


def test_format_rewards():
    assert format_number(" **47.** ", "") == 1.0 and format_number("47 apples", "") == 0.0
    assert format_boxed(r"so \boxed{3}", "") == 1.0 and format_boxed(r"\boxed{3", "") == 0.0
    assert format_answer("work\nAnswer: 1+2", "") == 1.0 and format_answer("<answer>1</answer>", "") == 1.0
    assert format_answer("the answer is 3", "") == 0.0


def test_plugin_contract_dotted_path():
    """A plug-in is any importable `fn(response_text, ground_truth) -> number`, named `module:function`;
    it works inline and in worker processes, and can be combined with built-ins."""
    fn = get_reward_fn("reward_fns_for_tests:length_bonus")
    assert fn("ab", "") == 2
    combined = get_reward_fn("reward_fns_for_tests:length_bonus + 0.5*format_number")
    assert combined("7", "") == 1.5
    with RewardRunner(combined, num_workers=1, timeout_s=5.0) as runner:
        assert runner.score([("7", ""), ("abcd", "")]).scores == [1.5, 3.0]


@pytest.mark.parametrize(
    "name, message",
    [
        ("nope", "built-in"),
        ("no_such_module_xyz:fn", "cannot import"),
        ("reward_fns_for_tests:missing", "no function"),
        ("number + 2*", "weight"),
        # every call would fail: refused at start-up instead of scoring every sample an error
        (
            "reward_fns_for_tests:one_argument",
            r"one_argument\(response_text\) cannot be called as fn\(response_text, ",
        ),
        ("reward_fns_for_tests:keyword_only", "cannot be called as fn"),
        ("number + reward_fns_for_tests:one_argument", "too many positional arguments"),
    ],
)
def test_bad_names_raise_with_a_fix(name, message):
    with pytest.raises(ValueError, match=message):
        get_reward_fn(name)
