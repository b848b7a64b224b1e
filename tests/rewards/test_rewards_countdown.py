"""Countdown reward: safe evaluation, each number exactly once, target reached."""

import json

import pytest

from rlloom.rewards.countdown import countdown_reward, evaluate_expression, extract_expression

TRUTH = json.dumps({"numbers": [3, 4, 5], "target": 35})


@pytest.mark.parametrize(
    "response",
    [
        "(3 + 4) * 5",
        "Let me think.\nAnswer: (3 + 4) * 5",
        "<answer>5 * (4 + 3)</answer>",
        "answer: (3 + 4) * 5 = 35",
        "**(3 + 4) × 5**",
        "Answer: `(4 + 3) * 5`.",
    ],
)
def test_correct_expressions_score_one(response):
    assert countdown_reward(response, TRUTH) == 1.0


@pytest.mark.parametrize(
    "response",
    [
        "(3 + 4) * 6",  # a number that was not given
        "7 * 5",  # 7 is not given
        "(3 + 4) * 5 + 0",  # 0 is not given
        "3 * 4 + 5",  # wrong value
        "(3 + 4) * 5 * 5 / 5",  # 5 used three times
        "35",
        "-(3 - 4) * 5 * 7",  # unary minus is not allowed
        "__import__('os').system('true')",
        "3 ** 4 ** 5",
        "5 / (4 - 4) + 3",
        "",
        "(" * 300 + "3" + ")" * 300,
    ],
)
def test_wrong_or_unsafe_expressions_score_zero(response):
    assert countdown_reward(response, TRUTH) == 0.0


def test_division_is_exact():
    truth = json.dumps({"numbers": [6, 4, 2], "target": 3})
    assert countdown_reward("6 / 4 * 2", truth) == 1.0  # 1.5 * 2, no float rounding
    value, used = evaluate_expression("(1 + 2) / 3")
    assert value == 1 and used == [1, 2, 3]


def test_extraction_order():
    assert extract_expression("Answer: 1 + 2\n<answer>3 + 4</answer>") == "3 + 4"
    assert extract_expression("first line\n\n  2 * 3  \n") == "2 * 3"


def test_bad_ground_truth_raises_with_a_fix():
    with pytest.raises(ValueError, match="numbers"):
        countdown_reward("1 + 2", "3")
