"""Imports flow one way through the package (docs/architecture.md): a module may import its own
layer or the layers below it, never one above, and the packages of one layer form no cycle.
Lazy imports inside functions count too: they are dependencies all the same."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parents[1] / "rlloom"

LAYERS = [
    {"devices", "determinism", "config", "faults", "compile_cache", "heap", "run_files"},
    {"data", "observability"},
    {"algorithms", "models", "tasks", "rewards"},
    {"parallel"},
    {"engines"},
    {"workers"},
    {"cluster", "weight_sync", "episodes", "agents"},
    {"trainer", "plan"},
    {"cli"},
]
LAYER_OF = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


def package_of(path: Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0].removesuffix(".py")


def imported_packages(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "rlloom" and len(parts) > 1:
                found.add(parts[1])
    return found


def edges() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        if path.name == "__init__.py" and path.parent == ROOT:
            continue
        graph.setdefault(package_of(path), set()).update(imported_packages(path))
    return graph


def test_every_package_has_a_layer():
    assert set(edges()) <= set(LAYER_OF), f"place these in LAYERS: {sorted(set(edges()) - set(LAYER_OF))}"


def test_no_import_runs_upward():
    upward = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.name == "__init__.py" and path.parent == ROOT:
            continue
        here = package_of(path)
        for target in sorted(imported_packages(path)):
            if LAYER_OF.get(target, -1) > LAYER_OF.get(here, -1):
                upward.append(f"{path.relative_to(ROOT.parent)} ({here}) imports rlloom.{target}")
    assert not upward, "imports running upward:\n" + "\n".join(upward)


def test_packages_of_one_layer_form_no_cycle():
    graph = edges()
    for layer in LAYERS:
        for a in layer:
            for b in layer:
                if a < b and b in graph.get(a, set()) and a in graph.get(b, set()):
                    raise AssertionError(f"rlloom.{a} and rlloom.{b} import each other")


def full_imports(path: Path) -> set[str]:
    """Every `rlloom.*` module a file imports, by its full dotted name (lazy imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {name for name in found if name.startswith("rlloom.")}


def test_the_controller_reaches_engines_only_through_their_build_modules():
    """trainer/ asks `engines/{train,rollout}/build.py` (and the interfaces) for start-up checks,
    engines and checkpoint reading; it never imports a backend (`engines.*.native`) or the
    parallelism code (`parallel/`), so a second backend plugs in without touching the controller."""
    reaching = [
        f"{path.relative_to(ROOT.parent)} imports {name}"
        for path in sorted((ROOT / "trainer").rglob("*.py"))
        for name in sorted(full_imports(path))
        if name.startswith("rlloom.parallel") or ".native" in name
    ]
    assert not reaching, "the controller reaches into engines:\n" + "\n".join(reaching)
