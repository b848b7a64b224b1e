"""The engine interfaces tell the truth: every attribute that the workers, the weight syncs, the
cluster and the controller use on an engine (or on a weight-sync source) is declared by its
protocol (`RolloutEngine`, `TrainEngine`, `WeightSource`), so a second backend that implements
the protocol works wherever the native engines do. A caller that needs more extends the protocol
first. The scan reads the source (no engine is built), so it covers paths no CPU test runs."""

from __future__ import annotations

import ast
from pathlib import Path

from rlloom.engines.rollout.base import RolloutEngine
from rlloom.engines.rollout.native import NativeEngine
from rlloom.engines.train.base import TrainEngine
from rlloom.engines.train.native import NativeTrainEngine
from rlloom.weight_sync.base import WeightSource

ROOT = Path(__file__).parents[2] / "rlloom"
CALLERS = ("workers", "weight_sync", "cluster", "trainer", "engines/train/hf_folder.py")
"""Where engines are used from outside their backend folders."""

KINDS = {
    ("workers/train.py", "self.engine"): TrainEngine,
    ("workers/train.py", "self.ref"): TrainEngine,
    ("workers/critic.py", "self.engine"): TrainEngine,
    ("workers/rollout.py", "self.engine"): RolloutEngine,
    ("workers/stream.py", "self.engine"): RolloutEngine,
    ("workers/flights.py", "engine"): RolloutEngine,
    ("weight_sync/checksum.py", "engine"): RolloutEngine,
    ("weight_sync/inplace.py", "sink"): RolloutEngine,
    ("weight_sync/receive.py", "sink"): RolloutEngine,
    ("weight_sync/inplace.py", "source"): WeightSource,
    ("weight_sync/broadcast.py", "source"): WeightSource,
    ("engines/train/hf_folder.py", "engine"): TrainEngine,
    ("trainer/eval_model.py", "engine"): RolloutEngine,
    ("trainer/export.py", "engine"): TrainEngine,
}
"""(file, receiver) -> the protocol its object satisfies. Every engine-like receiver the scan finds
must be listed here, so a new caller is checked too."""


def _engine_like(node: ast.expr, path: str) -> bool:
    """An expression that holds an engine: `engine`, `*_engine`, `x.engine`, `self.ref`, and in
    weight_sync the `source` and `sink` of a sync."""
    if isinstance(node, ast.Name):
        weight_sync_ends = path.startswith("weight_sync/") and node.id in ("source", "sink")
        return node.id == "engine" or node.id.endswith("_engine") or weight_sync_ends
    if isinstance(node, ast.Attribute):
        return node.attr == "engine" or node.attr.endswith("_engine") or ast.unparse(node) == "self.ref"
    return False


def _uses() -> dict[tuple[str, str], set[str]]:
    """(file, receiver) -> attributes read or called on it, `getattr(x, "name")` included."""
    found: dict[tuple[str, str], set[str]] = {}
    for caller in CALLERS:
        top = ROOT / caller
        for file in [top] if top.is_file() else sorted(top.rglob("*.py")):
            path = str(file.relative_to(ROOT))
            for node in ast.walk(ast.parse(file.read_text())):
                if isinstance(node, ast.Attribute) and _engine_like(node.value, path):
                    found.setdefault((path, ast.unparse(node.value)), set()).add(node.attr)
                elif (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr")
                    and _engine_like(node.args[0], path)
                ):
                    name = node.args[1].value if isinstance(node.args[1], ast.Constant) else "?"
                    found.setdefault((path, ast.unparse(node.args[0])), set()).add(name)
    return found


def _declared(protocol: type) -> set[str]:
    names = set(getattr(protocol, "__annotations__", {}))
    return names | {n for n in vars(protocol) if not n.startswith("_")}


def test_callers_use_only_what_the_engine_protocols_declare():
    uses = _uses()
    unclassified = sorted(set(uses) - set(KINDS))
    assert not unclassified, f"engine receivers with no protocol in KINDS: {unclassified}"
    undeclared = [
        f"{path}: {receiver}.{attr} is not declared by {KINDS[path, receiver].__name__}"
        for (path, receiver), attrs in sorted(uses.items())
        for attr in sorted(attrs - _declared(KINDS[path, receiver]))
    ]
    assert not undeclared, "\n".join(undeclared)


def test_the_native_engines_implement_their_protocols():
    for engine, protocol in ((NativeEngine, RolloutEngine), (NativeTrainEngine, TrainEngine)):
        missing = [n for n in sorted(_declared(protocol)) if not hasattr(engine, n)]
        # instance attributes set in __init__ are not on the class: look for their assignment
        source = Path(__import__(engine.__module__, fromlist=["_"]).__file__).read_text()
        missing = [n for n in missing if f"self.{n} =" not in source and f"self.{n}: " not in source]
        assert not missing, f"{engine.__name__} lacks {missing} of {protocol.__name__}"
