"""Turn a recipe name or a YAML file plus dotted overrides into one validated `RunConfig`.

The section dataclasses (`run.py` and one module per section) are the single source of truth: a
recipe returns a `RunConfig`, a YAML file is a (partial) nested mapping of the same fields, and
`a.b=value` overrides set single fields. Everything is merged as plain data first, then the
dataclasses are built once, which runs every check before anything heavy starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

from rlloom.config.aliases import rlloom_keys
from rlloom.config.checks import ConfigError
from rlloom.config.run import RunConfig
from rlloom.config.yaml_text import parse_override_value, read_yaml_file


def to_dict(cfg: Any) -> dict[str, Any]:
    """A dataclass config as nested plain data (tuples become lists, as in YAML)."""

    def plain(v: Any) -> Any:
        if dataclasses.is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v

    return plain(cfg)


TASK_ONLY_FIELDS: dict[str, tuple[str, ...]] = {
    "num_digits": ("arithmetic", "visual_compare"),
    "operators": ("arithmetic",),
    "num_train": ("arithmetic", "countdown", "visual_compare", "visual_colour"),
}
"""`data` fields that only some tasks read: `to_yaml` leaves them out of the other tasks' configs."""


def task_dict(cfg: RunConfig) -> dict[str, Any]:
    """`to_dict(cfg)` without the `data` fields its task does not read (see `TASK_ONLY_FIELDS`)."""
    data = to_dict(cfg)
    for name, tasks in TASK_ONLY_FIELDS.items():
        if cfg.data.task not in tasks:
            del data["data"][name]
    return data


def to_yaml(cfg: RunConfig) -> str:
    """The resolved config as YAML, without the `data` fields its task does not read; `load_config`
    of this text gives back a config equal in every field the task reads."""
    return yaml.safe_dump(task_dict(cfg), sort_keys=False, default_flow_style=False)


def show_config(source: str, overrides: list[str] | None = None) -> str:
    """`rlloom config show`: the resolved config as YAML. For a recipe, `trainer.run_dir` is shown as a
    comment (unless an override sets it), so that a YAML file saved from this output runs in
    runs/<file name> like any YAML file, instead of in (and resuming from) the recipe's folder."""
    from rlloom.config import recipes

    text = to_yaml(load_config(source, overrides))
    if source in recipes.RECIPES and not any(o.startswith("trainer.run_dir=") for o in overrides or []):
        text = re.sub(
            r"^  run_dir: (.*)$",
            r"  # run_dir: \1   (the recipe's; a YAML file's run goes to runs/<file name> unless it sets run_dir)",
            text,
            count=1,
            flags=re.M,
        )
    return text


def recipe_names() -> list[str]:
    from rlloom.config import recipes

    return sorted(recipes.RECIPES)


def _file_defaults(data: dict[str, Any], loaded: dict[str, Any], path: Path) -> None:
    """What a YAML file means beyond its keys: paths it names are relative to its own folder
    (`data.path`, and `model.path` when that folder holds it), its plug-in reward modules import
    from there, and its run goes to `runs/<file name>` unless it names `trainer.run_dir` (not the
    recipe's folder, which another run of the recipe uses)."""
    folder = path.resolve().parent
    named = {section: (loaded.get(section) or {}) for section in ("data", "model", "reward", "trainer")}
    data_path = named["data"].get("path")
    if isinstance(data_path, str) and data_path and not Path(data_path).expanduser().is_absolute():
        data["data"]["path"] = str(folder / data_path)
    model_path = named["model"].get("path")
    if isinstance(model_path, str) and model_path and (folder / model_path).exists():
        data["model"]["path"] = str(folder / model_path)
    if "import_dir" not in named["reward"]:
        data["reward"]["import_dir"] = str(folder)
    if "run_dir" not in named["trainer"]:
        data["trainer"]["run_dir"] = f"runs/{path.stem}"


def load_config(source: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Resolve `source` (recipe name, YAML path, a run folder holding the `config.yaml` its run
    wrote, or None for the defaults) and apply `key.sub=value` overrides."""
    from rlloom.config import recipes

    if source is not None:
        source = str(source)
        if Path(source).is_dir() and (Path(source) / "config.yaml").is_file():
            source = str(Path(source) / "config.yaml")  # a run folder: the config the run wrote
    if source is None:
        data = to_dict(RunConfig())
    elif source in recipes.RECIPES:
        data = to_dict(recipes.RECIPES[source]())
    elif source.endswith((".yaml", ".yml")) or Path(source).is_file():
        path = Path(source)
        if not path.is_file():
            raise ConfigError(
                f"config file {source!r} does not exist. Fix: pass an existing YAML file or a recipe ({', '.join(recipe_names())})."
            )
        loaded = read_yaml_file(path) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(
                f"config file {source!r} must hold a mapping of sections, found {type(loaded).__name__}. "
                "Fix: write one section per line, e.g. 'trainer:' followed by indented keys."
            )
        base = loaded.pop("recipe", None)
        if base is not None and not isinstance(base, str):
            raise ConfigError(
                f"recipe={base!r} in {source} is invalid: must be one recipe name. "
                f"Fix: e.g. recipe: {recipe_names()[0]}."
            )
        data = to_dict(recipes.RECIPES[base]()) if base in recipes.RECIPES else to_dict(RunConfig())
        if base is not None and base not in recipes.RECIPES:
            raise ConfigError(
                f"recipe={base!r} in {source} is unknown{_suggest(base, recipe_names())}. Known recipes: {', '.join(recipe_names())}."
            )
        _merge(data, loaded, RunConfig, prefix="")
        _file_defaults(data, loaded, path)
    else:
        raise ConfigError(
            f"{source!r} is neither a recipe nor a YAML file{_suggest(source, recipe_names())}. Known recipes: {', '.join(recipe_names())}."
        )
    for item in overrides or []:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(
                f"override {item!r} is invalid: must look like section.key=value. Fix: e.g. algorithm.eps_high=0.28."
            )
        nested: dict[str, Any] = {}
        node = nested
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = parse_override_value(key, raw)
        _merge(data, nested, RunConfig, prefix="")
    return build(RunConfig, data, prefix="")


def _closest(name: str, options: list[str]) -> str | None:
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    return close[0] if close else None


def _suggest(name: str, options: list[str]) -> str:
    close = _closest(name, options)
    return f" (did you mean {close!r}?)" if close else ""


def _merge(dst: dict[str, Any], src: dict[str, Any], cls: type, prefix: str) -> None:
    """Merge `src` into `dst` in place, rejecting keys that `cls` does not have."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in src.items():
        dotted = f"{prefix}{key}"
        if key not in fields:
            options = [f"{prefix}{k}" for k in fields]
            if known_elsewhere := _other_frameworks_keys(dotted, value):
                raise ConfigError(f"unknown config key {dotted!r}: {known_elsewhere}")
            raise ConfigError(
                f"unknown config key {dotted!r}{_suggest(dotted, options)}. Valid keys here: {', '.join(options)}."
            )
        ftype = _field_type(cls, key)
        if dataclasses.is_dataclass(ftype):
            if not isinstance(value, dict):
                raise ConfigError(
                    f"{dotted}={value!r} is invalid: {dotted} is a section, not a value. Fix: set its keys, e.g. {dotted}.{next(iter(f.name for f in dataclasses.fields(ftype)))}=...."
                )
            _merge(dst.setdefault(key, {}), value, ftype, prefix=f"{dotted}.")
        else:
            dst[key] = value


def _other_frameworks_keys(dotted: str, value: Any) -> str:
    """For an unknown key that is TRL's or verl's name for rlloom keys (itself or, for a section of
    theirs, the keys under it): "rlloom calls this ..." and the fix; else ''."""
    found = [(leaf, v, keys) for leaf, v in _leaves(dotted, value) if (keys := rlloom_keys(leaf))]
    if not found:
        return ""
    named = "; ".join(
        f"rlloom calls this {' and '.join(keys)}"
        if leaf == dotted
        else f"{leaf} is rlloom's {' and '.join(keys)}"
        for leaf, _, keys in found
    )
    fix = " ".join(f"{key}={_override_text(v)}" for _, v, keys in found for key in keys)
    return f"{named} (another framework's name). Fix: {fix}."


def _leaves(dotted: str, value: Any) -> list[tuple[str, Any]]:
    """(dotted key, value) of every non-mapping value under `dotted` (itself when not a mapping)."""
    if not isinstance(value, dict) or not value:
        return [(dotted, value)]
    return [leaf for k, v in value.items() for leaf in _leaves(f"{dotted}.{k}", v)]


def _override_text(value: Any) -> str:
    """A value as an override writes it (YAML flow style: 0.28, true, [0.9, 0.99])."""
    return yaml.safe_dump(value, default_flow_style=True, width=1000).strip().removesuffix("\n...").strip()


def _field_type(cls: type, name: str) -> Any:
    return typing.get_type_hints(cls, vars(importlib.import_module(cls.__module__)))[name]


def build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    """Construct `cls` from plain data, checking each value against the field's type."""
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        ftype = _field_type(cls, f.name)
        dotted = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(ftype):
            kwargs[f.name] = build(ftype, data[f.name], prefix=f"{dotted}.")
        else:
            kwargs[f.name] = _coerce(data[f.name], ftype, dotted)
    return cls(**kwargs)


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin, args = get_origin(tp), get_args(tp)
    if origin is Literal:
        if value not in args:
            fix = f"{key}={_closest(str(value), [str(a) for a in args]) or args[0]}"
            raise ConfigError(
                f"{key}={value!r} is invalid: must be one of {', '.join(map(repr, args))}. Fix: e.g. {fix}."
            )
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0])
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r} is invalid: must be a list. Fix: e.g. {key}=[...].")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(
                    f"{key}={value!r} is invalid: must have {len(args)} entries. Fix: give {len(args)}, e.g. {key}=[...]."
                )
            return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        inner = args[0] if args else Any
        items = [_coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigError(
                f"{key}={value!r} is invalid: must be a mapping of names to values. Fix: e.g. {key}={{name: 1}}."
            )
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(
            f"{key}={value!r} is invalid: must be true or false. Fix: {key}=true or {key}=false."
        )
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(
            f"{key}={value!r} is invalid: must be an integer. Fix: give a whole number, e.g. {key}=4."
        )
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-6 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(
            f"{key}={value!r} is invalid: must be a number. Fix: give a number, e.g. {key}=0.5."
        )
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}={value!r} is invalid: must be a string. Fix: quote it, e.g. {key}='...'.")
    raise ConfigError(f"{key}: unsupported config type {tp!r}")
