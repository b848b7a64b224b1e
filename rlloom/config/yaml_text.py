"""YAML text of configs, read strictly: every problem is one `ConfigError` line.

- `read_yaml_file(path)`: a config file must be UTF-8, valid YAML, and give each key once (PyYAML
  would silently keep the last of two).
- `parse_override_value(key, raw)`: the value of one `key=raw` override, refusing a `#` that YAML
  would read as a comment (which would silently cut the value).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from rlloom.config.checks import ConfigError


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, except that a key given twice in one mapping is an error (PyYAML would
    silently keep the last one)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        self.flatten_mapping(node)
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                seen = key in first_line
            except TypeError:
                raise yaml.constructor.ConstructorError(
                    None, None, f"found a key that is not a name ({key!r})", key_node.start_mark
                ) from None
            if seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"found duplicate key {key!r} (first given on line {first_line[key] + 1})",
                    key_node.start_mark,
                )
            first_line[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


MAX_NODES = 100_000
"""Values a config may hold once its aliases are expanded (a recipe holds a few hundred). YAML's
aliases (`*a`) share one object, so a few hundred bytes can stand for 10**9 values ("billion
laughs"): PyYAML builds them at once, but every later walk (merging, checking, printing) expands them."""


def _expanded_size(value: Any, sizes: dict[int, int], open_ids: set[int]) -> int:
    """Values in `value` with every alias expanded, counted once per distinct object (`sizes` memo);
    a container that holds itself (`&a [*a]`) counts as too many."""
    if not isinstance(value, dict | list):
        return 1
    if id(value) in sizes:
        return sizes[id(value)]
    if id(value) in open_ids:
        return MAX_NODES + 1
    open_ids.add(id(value))
    children = [*value.keys(), *value.values()] if isinstance(value, dict) else value
    size = 1 + sum(_expanded_size(child, sizes, open_ids) for child in children)
    open_ids.discard(id(value))
    sizes[id(value)] = min(size, MAX_NODES + 1)
    return sizes[id(value)]


def _bounded(value: Any, where: str, fix: str) -> Any:
    """`value` unless its expanded size is over MAX_NODES (a ConfigError naming `where`)."""
    if _expanded_size(value, {}, set()) > MAX_NODES:
        raise ConfigError(
            f"{where} expands to more than {MAX_NODES} values through its YAML aliases (*name): nested aliases "
            f"multiply, and a config this large is not a config. Fix: {fix}."
        )
    return value


def _yaml_problem(e: Exception) -> str:
    """A YAML error as one line: what is wrong and where."""
    if isinstance(e, RecursionError):
        return "nested too deeply"
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{problem}{where}"


def read_yaml_file(path: Path) -> Any:
    """Parse a YAML config file (UTF-8, unique keys); every problem is one `ConfigError` line."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"config file {str(path)!r} is not UTF-8 text (byte 0x{raw[e.start]:02x} on line {line}). "
            "Fix: save the file as UTF-8."
        ) from None
    try:
        loaded = yaml.load(text, Loader=_UniqueKeyLoader)
        return _bounded(
            loaded, f"config file {str(path)!r}", "write the values out, or use fewer nested aliases"
        )
    except (yaml.YAMLError, RecursionError) as e:
        fix = (
            "remove or rename one of the two"
            if "duplicate key" in _yaml_problem(e)
            else "correct the YAML syntax there (indent with spaces; quote values holding ': ' or ' #')"
        )
        raise ConfigError(
            f"config file {str(path)!r} is not valid YAML: {_yaml_problem(e)}. Fix: {fix}."
        ) from None


def parse_override_value(key: str, raw: str) -> Any:
    """The YAML value of one `key=raw` override ('' stays an empty string).

    A `#` that YAML would read as the start of a comment is refused instead of silently cutting
    the value; quoting keeps it (key='a #b')."""
    if raw == "":
        return ""
    try:
        tokens = list(yaml.scan(raw))
        value = _bounded(yaml.load(raw, Loader=_UniqueKeyLoader), f"override {key}", "write the value out")
    except (yaml.YAMLError, RecursionError) as e:
        raise ConfigError(
            f"override {key}={raw!r} is not a valid value: {_yaml_problem(e)}. "
            f"Fix: quote it, e.g. {key}='...', or close its brackets."
        ) from None
    end = max((t.end_mark.index for t in tokens if not isinstance(t, yaml.StreamEndToken)), default=0)
    if raw[end:].strip():
        raise ConfigError(
            f"override {key}={raw!r} is invalid: a '#' at the start or after a space opens a YAML comment, which would cut the value "
            f"to {value!r}. Fix: quote the value, e.g. {key}='{raw}'."
        )
    return value
