"""Reward functions for the runner and plug-in tests; a separate module so that worker processes
import it (and nothing heavier) to unpickle them."""

import os
import sys
import time


def echo_score(response_text, ground_truth):
    """Well-behaved: the ground truth as a float, after checking the response."""
    return float(ground_truth) if response_text == "ok" else 0.0


def misbehave(response_text, ground_truth):
    """Misbehaves according to the response text."""
    if response_text == "hang":
        time.sleep(3600)
    if response_text == "raise":
        raise RuntimeError("reward bug")
    if response_text == "crash":
        os._exit(3)
    bad = {"none": None, "nan": float("nan"), "inf": float("inf"), "abc": "abc"}
    if response_text in bad:
        return bad[response_text]
    return float(ground_truth)


def modules_loaded(response_text, ground_truth):
    """1.0 when the module named by the response is imported in this process."""
    return 1.0 if response_text in sys.modules else 0.0


def length_bonus(response_text, ground_truth):
    """A plug-in: 1.0 per character up to 3, as an int (ints are valid scores)."""
    return min(len(response_text), 3)
