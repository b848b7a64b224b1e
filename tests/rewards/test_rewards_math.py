"""Math answers: boxed and GSM8K extraction, the fallback comparison, and math_verify (a core dependency)."""

import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from rlloom.rewards import RewardRunner
from rlloom.rewards import math_answer as ma


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so \boxed{42}.", "42"),
        (r"\boxed{1} then \boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{\{1, 2\} \cup \{3\}}", r"\{1, 2\} \cup \{3\}"),
        (r"\boxed{x^{2}}", "x^{2}"),
        (r"cut off \boxed{\frac{1}{2", None),
        ("no box", None),
    ],
)
def test_extract_boxed(text, expected):
    assert ma.extract_boxed(text) == expected


def test_extract_gsm8k_and_priority():
    assert ma.extract_hash_answer("She has 3 + 4 = 7 apples.\n#### 7") == "7"
    assert ma.extract_hash_answer("#### ") is None
    assert ma.extract_math_answer(r"#### 5 but \boxed{6}") == "6"


@pytest.mark.parametrize(
    "response, truth",
    [
        (r"\boxed{42}", "42"),
        (r"The answer is $\boxed{1,000}$.", "1000"),
        (r"\boxed{\dfrac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{\frac{2}{4}}", "1/2"),
        (r"\boxed{0.5}", r"\frac{1}{2}"),
        (r"\boxed{\text{(B)}}", "(B)"),
        (r"\boxed{50\%}", "50"),
        ("Total: 3 + 4 = 7\n#### 7", "Natalia sold 48/2 = 24 clips.\n#### 7"),
        (r"\boxed{ x + 1 }", "x+1"),
    ],
)
def test_fallback_accepts_equal_answers(response, truth):
    assert ma.math_answer(response, truth) == 1.0


@pytest.mark.parametrize(
    "response, truth",
    [(r"\boxed{41}", "42"), ("42", "42"), (r"\boxed{\frac{1}{3}}", "0.5"), (r"\boxed{x+2}", "x+1")],
)
def test_rejects_wrong_or_unmarked_answers(response, truth):
    # "42" without \boxed or "####" is not a final answer for this reward.
    assert ma.math_answer(response, truth) == 0.0


def test_math_verify_is_installed():
    # A core dependency: the default install must score symbolic answers with it.
    assert ma.math_verify_module() is not None, "math-verify missing: pip install math-verify"


@pytest.mark.parametrize(
    "response, truth",
    [
        (r"\boxed{\frac12}", "0.5"),
        (r"\boxed{\{3, 1, 2\}}", r"\{1,2,3\}"),
        (r"\boxed{\sqrt{4}}", "2"),
        (r"\boxed{\pi/2}", r"\frac{\pi}{2}"),
        (r"\boxed{1+2x}", "2x+1"),
        (r"The answer is \boxed{\frac{\sqrt{8}}{2}}", r"\sqrt{2}"),
    ],
)
def test_math_verify_accepts_equivalent_forms(response, truth):
    assert ma.math_answer(response, truth) == 1.0


@pytest.mark.parametrize(
    "response, truth",
    [(r"\boxed{\sqrt{5}}", "2"), (r"\boxed{\pi/3}", r"\frac{\pi}{2}"), (r"\boxed{\{1, 2\}}", r"\{1,2,3\}")],
)
def test_math_verify_rejects_different_values(response, truth):
    assert ma.math_answer(response, truth) == 0.0


def test_math_verify_works_off_the_main_thread():
    # Its signal-based timeouts fail in threads; the reward must still see the match there.
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(ma.math_answer, r"\boxed{\sqrt{4}}", "2").result() == 1.0


def test_fallback_without_math_verify(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # `import math_verify` now raises ImportError
    assert ma.math_verify_module() is None
    assert ma.math_answer(r"\boxed{\frac12}", "0.5") == 0.0  # needs a symbolic reader
    assert ma.math_answer(r"\boxed{\sqrt{4}}", "2") == 0.0
    assert ma.math_answer(r"\boxed{\frac{1}{2}}", "0.5") == 1.0  # the fallback reads simple fractions
    assert ma.math_answer(r"\boxed{1,000}", "1000") == 1.0


def test_a_blank_ground_truth_is_an_error_not_a_match():
    # an empty \boxed{} matched an empty answer: 1.0 for nothing
    for truth in ("", "  "):
        with pytest.raises(ValueError, match="ground truth is empty"):
            ma.math_answer(r"\boxed{}", truth)
    result = RewardRunner(ma.math_answer).score([(r"\boxed{}", ""), (r"\boxed{3}", "3")])
    assert result.scores == [0.0, 1.0] and result.num_errors == 1
