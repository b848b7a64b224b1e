r"""Format rewards: 1.0 when a response has the shape the task asks for, else 0.0.

They are meant as a small bonus next to a correctness reward, combined with a weight through
`rlloom.rewards.weighted.WeightedReward` (or the registry's "number + 0.1*format_number" syntax):
- `format_number`: the whole response is one number ("47", "**47**", "47.", "-3.5");
- `format_boxed`: the response has a closed `\boxed{...}`;
- `format_answer`: the response has `<answer>...</answer>` or a line starting with "Answer:".
"""

from __future__ import annotations

import re

from rlloom.rewards.math_answer import extract_boxed
from rlloom.rewards.numbers import parse_number


def format_number(response_text: str, ground_truth: str) -> float:
    """1.0 when the response is just a number (markdown bold and a final period allowed)."""
    return 1.0 if parse_number(response_text.strip().strip("*").strip()) is not None else 0.0


def format_boxed(response_text: str, ground_truth: str) -> float:
    r"""1.0 when the response holds a closed `\boxed{...}`."""
    return 1.0 if extract_boxed(response_text) is not None else 0.0


def format_answer(response_text: str, ground_truth: str) -> float:
    """1.0 when the response has `<answer>...</answer>` or a line starting with 'Answer:'."""
    tagged = re.search(r"<answer>.*?</answer>", response_text, flags=re.DOTALL)
    line = re.search(r"^\s*answer\s*:", response_text, flags=re.IGNORECASE | re.MULTILINE)
    return 1.0 if tagged or line else 0.0
