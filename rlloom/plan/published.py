"""The published config.json files of common models, shipped with rlloom (`configs/<name>/config.json`,
architecture fields only, no weights), so `rlloom plan qwen3-30b-a3b ...` works offline. Their
sources are listed in `configs/README.md`."""

from __future__ import annotations

from pathlib import Path

CONFIG_DIR = Path(__file__).parent / "configs"


def published_names() -> list[str]:
    """The model names `rlloom plan` takes, e.g. `qwen3-8b`, `deepseek-v3`."""
    return sorted(p.name for p in CONFIG_DIR.iterdir() if (p / "config.json").is_file())


def published_config(name: str) -> Path | None:
    """The shipped config.json of `name` (case-insensitive; a Hub id such as `Qwen/Qwen3-8B` names
    its model), or None when rlloom ships none."""
    folder = CONFIG_DIR / name.rsplit("/", 1)[-1].lower()
    return folder / "config.json" if (folder / "config.json").is_file() else None
