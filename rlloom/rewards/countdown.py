"""Countdown reward: 1.0 when the response's expression uses each given number exactly once and
evaluates to the target, else 0.0.

The expression is read from, in order: the last `<answer>...</answer>`, the text after the last
"Answer:", or the last non-empty line. A trailing "= 29" is dropped. It is evaluated with exact
fractions by walking its syntax tree (`ast`, never `eval`): only integer literals, + - * /, and
parentheses are allowed (no unary minus, powers or names), so a response cannot run code or
build huge numbers.
"""

from __future__ import annotations

import ast
import json
import re
from fractions import Fraction

_MAX_EXPRESSION_CHARS = 200
_OPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}
_SYMBOLS = {"\u00d7": "*", "\u00f7": "/", "\u2212": "-", "\\times": "*", "\\div": "/", "\\cdot": "*"}


def extract_expression(text: str) -> str | None:
    """The candidate expression of a response (see the module docstring), cleaned, or None."""
    tags = re.findall(r"<answer>(.*?)</answer>", text, flags=re.DOTALL)
    if tags:
        candidate = tags[-1]
    elif re.search(r"answer\s*:", text, flags=re.IGNORECASE):
        candidate = re.split(r"answer\s*:", text, flags=re.IGNORECASE)[-1].strip().split("\n")[0]
    else:
        lines = [line for line in text.splitlines() if line.strip()]
        candidate = lines[-1] if lines else ""
    for symbol, op in _SYMBOLS.items():
        candidate = candidate.replace(symbol, op)
    candidate = candidate.strip("*`$ \t").rstrip(".").strip("*`$ \t")  # markdown bold, code, math
    candidate = candidate.split("=")[0].strip()  # "(3 + 4) * 5 = 35" -> "(3 + 4) * 5"
    return candidate or None


def evaluate_expression(expression: str) -> tuple[Fraction, list[int]] | None:
    """(exact value, integer literals in order) of an arithmetic expression, or None if it is not
    a valid one (other syntax, division by zero, too long)."""
    if len(expression) > _MAX_EXPRESSION_CHARS:
        return None
    try:
        tree = ast.parse(expression, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    numbers: list[int] = []
    try:
        value = _evaluate(tree.body, numbers)
    except (ValueError, ZeroDivisionError, RecursionError):
        return None
    return value, numbers


def _evaluate(node: ast.AST, numbers: list[int]) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        numbers.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _evaluate(node.left, numbers), _evaluate(node.right, numbers)
        return _OPS[type(node.op)](left, right)
    raise ValueError(f"not allowed in a countdown expression: {type(node).__name__}")


def parse_countdown_truth(ground_truth: str) -> tuple[list[int], int]:
    """The numbers and target of a ground truth `{"numbers": [...], "target": n}`."""
    try:
        data = json.loads(ground_truth)
        numbers, target = [int(n) for n in data["numbers"]], int(data["target"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"countdown reward: ground truth {ground_truth!r} is not JSON {{'numbers': [...], 'target': n}}; "
            "fix: use data.task=countdown or store answers in that form"
        ) from e
    return numbers, target


def countdown_reward(response_text: str, ground_truth: str) -> float:
    """1.0 for an expression using exactly the given numbers (each once) that equals the target."""
    numbers, target = parse_countdown_truth(ground_truth)
    expression = extract_expression(response_text)
    result = evaluate_expression(expression) if expression else None
    if result is None:
        return 0.0
    value, used = result
    return 1.0 if sorted(used) == sorted(numbers) and value == target else 0.0
