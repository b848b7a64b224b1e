"""The number reward reads the last number the way a person would."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlloom.rewards.numbers import last_number, number_match, parse_number


@pytest.mark.parametrize(
    "text, expected",
    [
        ("12 + 35 = 47", 47),
        ("The answer is 1,234.", 1234),
        ("x = -7", -7),
        ("12-5", 5),
        ("(3)-5", 5),
        ("**47**", 47),
        ("47.", 47),
        ("It is 3.25 meters", 3.25),
        ("1,2345", 2345),
        ("12,345,678 people", 12345678),
        ("\u22123", -3),
        ("no digits here", None),
        ("", None),
    ],
)
def test_last_number(text, expected):
    assert last_number(text) == expected


@pytest.mark.parametrize(
    "response, truth, score",
    [
        ("47", "47", 1.0),
        ("12 + 35 = 47", "47", 1.0),
        ("**47**", "47", 1.0),
        ("47.0", "47", 1.0),
        ("0.1 + 0.2 = 0.30000000000000004", "0.3", 1.0),
        ("-23", "-23", 1.0),
        ("23", "-23", 0.0),
        ("The answer is 1,234", "1234", 1.0),
        ("46", "47", 0.0),
        ("forty-seven", "47", 0.0),
        ("47 is the answer, not 48", "47", 0.0),
    ],
)
def test_number_match(response, truth, score):
    assert number_match(response, truth) == score


def test_non_numeric_ground_truth_raises_with_a_fix():
    with pytest.raises(ValueError, match="math"):
        number_match("47", "forty-seven")


@given(st.integers(min_value=-(10**12), max_value=10**12))
def test_any_integer_written_with_commas_or_plain_round_trips(n):
    assert parse_number(str(n)) == n
    assert parse_number(f"{n:,}") == n
    assert number_match(f"So the result is {n:,}.", str(n)) == 1.0
