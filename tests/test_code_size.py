"""Size limits of the package (issue 40's "done when"): no module in rlloom/ over 500 lines, no
function or method over 80 (decorators and docstring included). Past those, a file holds more than
one concept, or a function more than one screen of steps: split it where that reads better."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parents[1] / "rlloom"
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80


def function_lengths(tree: ast.Module) -> list[tuple[str, int, int]]:
    """(qualified name, first line, lines) of every function and method, nested ones included."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                    found.append((name, first, child.end_lineno - first + 1))
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def test_no_module_over_the_line_limit():
    long = []
    for path in sorted(ROOT.rglob("*.py")):
        lines = len(path.read_text().splitlines())
        if lines > MAX_FILE_LINES:
            long.append(f"{path.relative_to(ROOT.parent)}: {lines} lines")
    assert not long, f"modules over {MAX_FILE_LINES} lines:\n" + "\n".join(long)


def test_no_function_over_the_line_limit():
    long = []
    for path in sorted(ROOT.rglob("*.py")):
        for name, first, lines in function_lengths(ast.parse(path.read_text())):
            if lines > MAX_FUNCTION_LINES:
                long.append(f"{path.relative_to(ROOT.parent)}:{first} {name}: {lines} lines")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


def test_the_limits_see_a_long_function():
    """The counter counts what it should: a method's decorator, docstring and body."""
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_FUNCTION_LINES - 2))
    source = f"class A:\n    @property\n    def f(self):\n{body}\n"
    assert function_lengths(ast.parse(source)) == [("A.f", 2, MAX_FUNCTION_LINES)]
