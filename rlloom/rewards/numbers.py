"""Number answers read the way a person reads them: the LAST number in the response counts.

"12 + 35 = 47" -> 47; "1,234" -> 1234 (commas between groups of three digits); "= -7" -> -7 but
"12-5" -> 5 (a minus right after a digit, letter or ')' is subtraction, not a sign); "47." and
"**47**" -> 47; "3.25" -> 3.25. Integers compare exactly, anything with a fraction part compares
with a small relative tolerance.
"""

from __future__ import annotations

import math
import re

# A sign only when the minus does not follow a word character or ')' (that minus is subtraction).
# Thousands groups need exactly three digits and no digit after them ("1,2345" is not 12345).
_NUMBER = re.compile(r"(?:(?<![\w)])[-\u2212])?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")


def find_numbers(text: str) -> list[str]:
    """Every number in `text`, as written (signs and thousands commas kept), in order."""
    return _NUMBER.findall(text)


def parse_number(text: str) -> int | float | None:
    """A number written as digits ("1,234", "-7", "3.5", "47.", " 12 ") or None when it is not one."""
    cleaned = text.strip().replace("\u2212", "-").rstrip(".")
    match = _NUMBER.fullmatch(cleaned)
    if not match:
        return None
    digits = cleaned.replace(",", "")
    return float(digits) if "." in digits else int(digits)


def last_number(text: str) -> int | float | None:
    """The last number in `text`, or None when it has none."""
    found = find_numbers(text)
    return parse_number(found[-1]) if found else None


def numbers_equal(a: int | float, b: int | float, *, rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> bool:
    """Exact for two integers, within tolerance otherwise."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return math.isclose(a, b, rel_tol=rel_tol, abs_tol=abs_tol)


def number_match(response_text: str, ground_truth: str) -> float:
    """1.0 when the last number of the response equals the ground truth number, else 0.0.

    Raises ValueError when the ground truth is not a number (a dataset problem, counted as a
    reward error by the runner).
    """
    expected = parse_number(ground_truth)
    if expected is None:
        raise ValueError(
            f"number reward: ground truth {ground_truth!r} is not a number; "
            "fix: use the `math` reward for non-numeric answers, or fix the dataset's answer field"
        )
    got = last_number(response_text)
    return 1.0 if got is not None and numbers_equal(got, expected) else 0.0
