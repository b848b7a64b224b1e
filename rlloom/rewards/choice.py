"""Choice answers: the response, without surrounding whitespace, must be exactly the ground truth.

For tasks whose answer is one of a few fixed words or letters ("L" or "R" in `visual_compare`, "A"
to "D" in `visual_colour`): "L" matches "L" and " L\n"; "l", "L.", "Left" and "L R" do not. Nothing
is read into a malformed answer, so a model earns the reward only by answering in the asked form.
"""

from __future__ import annotations


def choice_match(response_text: str, ground_truth: str) -> float:
    """1.0 when the stripped response equals the ground truth, else 0.0."""
    if not ground_truth.strip():
        raise ValueError("the ground truth of a choice answer is empty; fix: give each row its answer")
    return 1.0 if response_text.strip() == ground_truth.strip() else 0.0
