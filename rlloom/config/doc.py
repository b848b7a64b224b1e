"""The configuration reference (docs/config.md), generated from the config dataclasses.

`config_reference()` walks `RunConfig`'s sections and reads each field's type and default from the
dataclass and its description from the docstring written under the field (read from the source
with `ast`, since Python keeps no field docstrings at runtime). `rlloom config doc` prints it; a
test fails when the checked-in docs/config.md differs from it.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import json
import types
import typing
from typing import Any, Literal, get_args, get_origin

from rlloom.config.run import RunConfig

REGENERATE = "rlloom config doc > docs/config.md"

_HEADER = f"""# Configuration reference

Every setting of a run, generated from the field docstrings in `rlloom/config/` (one module per
section) by `{REGENERATE}` (do not edit by hand). Set a field in a YAML file as a
nested mapping (`trainer: {{total_steps: 50}}`) or on the command line as a dotted override
(`trainer.total_steps=50`); `rlloom config show RECIPE_OR_YAML` prints every resolved value.
"""


def field_docstrings(cls: type) -> dict[str, str]:
    """{field name: the string literal right under it} of a class, read from its source."""
    module = ast.parse(inspect.getsource(importlib.import_module(cls.__module__)))
    node = next(n for n in ast.walk(module) if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    docs: dict[str, str] = {}
    for stmt, nxt in zip(node.body, node.body[1:]):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[stmt.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def type_name(tp: Any) -> str:
    """A short readable form of a field type: `int`, `list[str]`, `"a" | "b"`."""
    origin, args = get_origin(tp), get_args(tp)
    if origin is Literal:
        return " \\| ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(type_name(a) for a in args)
    if origin in (list, tuple):
        return f"{origin.__name__}[{', '.join(type_name(a) for a in args)}]"
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def default_text(f: dataclasses.Field) -> str:
    """The field's default as it would be written in YAML/JSON."""
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    return json.dumps(list(value) if isinstance(value, tuple) else value)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def section_table(name: str, cls: type) -> str:
    """One section's Markdown: a heading and a table of key, type, default and description."""
    hints = typing.get_type_hints(cls, vars(importlib.import_module(cls.__module__)))
    docs = field_docstrings(cls)
    rows = [
        f"| `{name}.{f.name}` | {type_name(hints[f.name])} | `{default_text(f)}` | {_cell(docs.get(f.name, ''))} |"
        for f in dataclasses.fields(cls)
    ]
    return "\n".join(
        [f"## `{name}`", "", "| Key | Type | Default | Description |", "|---|---|---|---|", *rows]
    )


def config_reference() -> str:
    """docs/config.md: every section of `RunConfig`, in order."""
    hints = typing.get_type_hints(RunConfig, vars(importlib.import_module(RunConfig.__module__)))
    sections = [section_table(f.name, hints[f.name]) for f in dataclasses.fields(RunConfig)]
    return "\n\n".join([_HEADER.rstrip(), *sections]) + "\n"
