"""Reward functions for the runner and plug-in tests; a separate module so that worker processes
import it (and nothing heavier) to unpickle them."""

import itertools
import os
import subprocess
import sys
import time
from pathlib import Path


def echo_score(response_text, ground_truth):
    """Well-behaved: the ground truth as a float, after checking the response."""
    return float(ground_truth) if response_text == "ok" else 0.0


def misbehave(response_text, ground_truth):
    """Misbehaves according to the response text; otherwise returns the ground truth as a float."""
    if response_text == "hang":
        time.sleep(3600)
    if response_text == "raise":
        raise RuntimeError("reward bug")
    if response_text == "crash":
        os._exit(3)
    if response_text == "exit":
        sys.exit(0)
    if response_text == "child":  # start a program that outlives the call, tell the test its pid, hang
        child = subprocess.Popen(["sleep", "3600"])
        Path(ground_truth).write_text(str(child.pid))
        time.sleep(3600)
    if response_text == "hog":  # touch 0.5 GiB, then score 1.0
        return 1.0 if len(bytearray(2**29)) else 0.0
    bad = {"none": None, "nan": float("nan"), "inf": float("inf"), "abc": "abc", "big": 1e39, "huge": 10**400}
    if response_text in bad:
        return bad[response_text]
    return float(ground_truth)


def hang_on_even_answers(response_text, ground_truth):
    """A plug-in for end-to-end runs: hangs when the ground truth is an even number, else 1.0."""
    if int(ground_truth) % 2 == 0:
        time.sleep(3600)
    return 1.0


def modules_loaded(response_text, ground_truth):
    """1.0 when the module named by the response is imported in this process."""
    return 1.0 if response_text in sys.modules else 0.0


def length_bonus(response_text, ground_truth):
    """A plug-in: 1.0 per character up to 3, as an int (ints are valid scores)."""
    return min(len(response_text), 3)


def uses_columns(response_text, ground_truth, prompt, level):
    """Per-sample form with named keywords: the row's `level` column, checked against the prompt."""
    return float(level) if prompt == f"level {level}" else -1.0


def uses_all_columns(response, truth, **columns):
    """Per-sample form with **kwargs: how many keyword arguments arrived (prompt + columns)."""
    return float(len(columns))


def batched_lengths(completions, prompts, ground_truths, level):
    """Batched form: one call per chunk; len(completion) + level, or a hang when asked to."""
    if "hang" in completions:
        time.sleep(3600)
    return [len(c) + lv for c, lv in zip(completions, level)]


def batched_wrong_length(completions, **columns):
    """Batched form that returns one score too few."""
    return [1.0] * (len(completions) - 1)


def one_argument(response_text):
    """Cannot take the ground truth: refused when the reward is resolved."""
    return 1.0


def keyword_only(*, response_text, ground_truth):
    """Cannot take its two arguments by position: refused too."""
    return 1.0


def needs_difficulty(response_text, ground_truth, difficulty, bonus=0.0):
    """Needs a `difficulty` column (and takes an optional `bonus`)."""
    return float(difficulty) + bonus


def batched_needs_level(completions, level):
    """Batched, needs a `level` column."""
    return [float(x) for x in level]


def start_daemon(response_text, ground_truth):
    """Starts, once, a daemon that leaves the worker's session (a double fork and setsid) holding
    the worker's stdout, and writes its pid to the file $DAEMON_PID_FILE. Scores 1.0."""
    pid_file = Path(os.environ["DAEMON_PID_FILE"])
    if not pid_file.exists():
        pid_file.write_text("")
        script = f"setsid sh -c 'echo $$ > {pid_file}; exec sleep 300' &"  # sh forks and exits at once
        subprocess.run(["sh", "-c", script], check=True)
        while not pid_file.read_text().strip():
            time.sleep(0.01)
    return 1.0


_calls = itertools.count()


def huge_or_numpy_true(response_text, ground_truth):
    """Every other call in a worker: -3e38 (a float32 whose group std overflowed), else numpy.True_
    (what `array > 0.5` holds; refused before)."""
    import numpy

    return -3e38 if next(_calls) % 2 else numpy.True_
