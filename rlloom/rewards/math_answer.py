r"""Math answers: the last `\boxed{...}` (nested braces allowed) or a GSM8K-style "#### 42" line.

Comparison, in order:
1. normalized forms equal: spaces, `$`, `\left`/`\right`, `\!`/`\,`, `\text{..}` wrappers, a trailing
   period, `^\circ` and percent signs removed, `\dfrac`/`\tfrac` read as `\frac`; numbers (commas
   allowed), simple fractions `a/b` and `\frac{a}{b}` compared by value;
2. otherwise math_verify's symbolic check (`verify(parse(gold), parse(answer))`; a core dependency
   of rlloom), which also knows that `\sqrt{4}` equals `2`, `\frac12` equals `0.5`, that sets and
   intervals match in any order, that `2x+1` equals `1+2x`, and so on.
Where `math_verify` cannot be imported (an install without it) only step 1 runs: it accepts no answer
that is wrong, but misses some right answers written in a different form.

The ground truth may be a bare answer or a full solution ending in `\boxed{..}` or "#### n".
"""

from __future__ import annotations

import re
import threading
from fractions import Fraction
from types import ModuleType

from rlloom.rewards.numbers import numbers_equal, parse_number


def math_verify_module() -> ModuleType | None:
    """The `math_verify` module, or None where it cannot be imported (the fallback then runs alone).

    Imported on first use, not at import time: it pulls in sympy, which would slow down the start
    of every reward worker process.
    """
    try:
        import math_verify
    except ImportError:
        return None
    return math_verify


def _symbolic_match(answer: str, gold: str) -> bool | None:
    """math_verify's verdict, or None without math_verify."""
    mv = math_verify_module()
    if mv is None:
        return None
    # Its timeouts use signal.alarm, which works only in the main thread; elsewhere run without them.
    main = threading.current_thread() is threading.main_thread()
    parse_kw, verify_kw = ({}, {}) if main else ({"parsing_timeout": None}, {"timeout_seconds": None})
    try:
        gold_parsed = mv.parse(f"${gold}$", **parse_kw)
        return bool(mv.verify(gold_parsed, mv.parse(f"${answer}$", **parse_kw), **verify_kw))
    except Exception:  # math_verify raises on LaTeX it cannot read; that is not a match
        return False


def extract_boxed(text: str) -> str | None:
    r"""The content of the last `\boxed{...}` (or `\fbox{...}`), with nested braces, or None."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None  # unbalanced: the response was cut off inside the box


def extract_hash_answer(text: str) -> str | None:
    """The text after the last '####' (GSM8K), up to the end of its line, or None."""
    matches = re.findall(r"####\s*([^\n]*)", text)
    return matches[-1].strip() if matches and matches[-1].strip() else None


def extract_math_answer(text: str) -> str | None:
    r"""The final answer of a solution: the last `\boxed{}`, else the '####' answer, else None."""
    boxed = extract_boxed(text)
    return boxed if boxed is not None else extract_hash_answer(text)


def normalize_answer(answer: str) -> str:
    """A canonical string form of a math answer (see the module docstring for what is removed)."""
    s = answer.strip()
    s = re.sub(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}", r"\1", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for token in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\ ", "$", "^\\circ", "^{\\circ}", "\\%", "%"):
        s = s.replace(token, "")
    s = re.sub(r"\s+", "", s).rstrip(".")
    while len(s) > 2 and s[0] == "{" and s[-1] == "}":
        s = s[1:-1]
    return s


def answer_value(normalized: str) -> Fraction | float | None:
    r"""The value of a normalized answer that is a number, `a/b` or `\frac{a}{b}`, else None."""
    number = parse_number(normalized)
    if number is not None:
        return Fraction(number) if isinstance(number, int) else number
    match = re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}|(-?\d+)/(-?\d+)", normalized)
    if not match:
        return None
    sign, a, b, c, d = match.groups()
    num, den = (int(a), int(b)) if a is not None else (int(c), int(d))
    if den == 0:
        return None
    return Fraction(-num if sign else num, den)


def answers_match(answer: str, gold: str) -> bool:
    """True when two extracted answers are the same (normalized string, then value, then math_verify)."""
    a, g = normalize_answer(answer), normalize_answer(gold)
    if a == g:
        return True
    va, vg = answer_value(a), answer_value(g)
    if va is not None and vg is not None:
        return (
            numbers_equal(float(va), float(vg))
            if isinstance(va, float) or isinstance(vg, float)
            else va == vg
        )
    return bool(_symbolic_match(answer, gold))


def math_answer(response_text: str, ground_truth: str) -> float:
    r"""1.0 when the response's final answer (`\boxed{}` or '####') matches the ground truth, else 0.0.

    Raises ValueError for a blank ground truth, which an empty `\boxed{}` would match (a dataset
    problem, counted as a reward error; dataset files skip such rows when they are read).
    """
    if not ground_truth.strip():
        raise ValueError(
            "math reward: the ground truth is empty, so any empty answer would match it; fix: give the "
            "row an answer, or drop it"
        )
    answer = extract_math_answer(response_text)
    if answer is None:
        return 0.0
    gold = extract_math_answer(ground_truth)
    return 1.0 if answers_match(answer, gold if gold is not None else ground_truth) else 0.0
