"""`calculate`: a calculator tool for `rollout.tools` (the `calculator_tools` recipe). It evaluates
arithmetic on numbers only (+ - * / // % ** and parentheses), never Python code."""

from __future__ import annotations

import ast
import operator

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def _eval(node: ast.AST) -> float:
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, (int, float))
        and not isinstance(node.value, bool)
    ):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large")
        return _OPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    raise ValueError(f"unsupported expression element {type(node).__name__}")


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The expression, e.g. "12 * (3 + 4)".
    """
    value = _eval(ast.parse(expression, mode="eval").body)
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"
