"""Sealed folders: a checkpoint folder whose every file is named, sized and hashed in a manifest.

    manifest.json   {"format": 1, "files": {relative path: {"bytes": n, "sha256": hex}}, "sealed": [...]}

The manifest is written last (after every file is fsynced), so a folder without one is an
interrupted save. `verify_folder` refuses, naming the file, a folder whose files are missing,
resized, changed (sha256) or not in the manifest (a planted file is never opened). A sub-folder
listed under "sealed" carries its own manifest: the parent hashes only that manifest (a hash chain)
and verifying the parent verifies the sub-folder too.

Folders are built under a temporary sibling and swapped in with `swap_in`: an existing folder of the
same name is first renamed to `<name>.old`, so at every moment one complete copy exists, under
`<name>` or `<name>.old`; `recover_parent` (run at start-up, under the run lock) finishes or undoes
an interrupted swap and deletes temporary folders of interrupted saves.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rlloom.run_files import open_text, refuse_link

MANIFEST = "manifest.json"
OLD_SUFFIX = ".old"
TMP_MARK = ".tmp"


class CheckpointError(ValueError):
    """A checkpoint folder is incomplete, damaged or does not fit the engine that loads it."""


def sha256_file(path: Path, chunk_bytes: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            digest.update(block)
    return digest.hexdigest()


def fsync_path(path: Path) -> None:
    """Flush a file's (or a folder's entries') data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _listed_files(root: Path, sealed: Iterable[str]) -> list[str]:
    """Files under `root` the manifest must list: all but the manifest and sealed sub-folders' contents
    (of those, only their manifest)."""
    sealed = set(sealed)
    out = []
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if p.is_dir() or rel.as_posix() == MANIFEST:
            continue
        if rel.parts[0] in sealed and rel.as_posix() != f"{rel.parts[0]}/{MANIFEST}":
            continue
        out.append(rel.as_posix())
    return out


def write_manifest(root: Path, sealed: Iterable[str] = ()) -> None:
    """Hash every file of `root` (see `_listed_files`) into `root/manifest.json`, written last."""
    sealed = list(sealed)
    files: dict[str, dict[str, Any]] = {}
    for rel in _listed_files(root, sealed):
        fsync_path(root / rel)
        files[rel] = {"bytes": (root / rel).stat().st_size, "sha256": sha256_file(root / rel)}
    with open_text(root / MANIFEST) as f:
        json.dump({"format": 1, "files": files, "sealed": sealed}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    fsync_path(root)


def read_manifest(root: Path) -> dict[str, Any]:
    path = root / MANIFEST
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint {str(root)!r} is incomplete: {MANIFEST} is missing (it is written last, so the save "
            "was interrupted or this is not an rlloom checkpoint). Fix: load an earlier complete checkpoint."
        )
    try:
        manifest = json.loads(path.read_text())
        manifest["files"].items()
    except (ValueError, KeyError, AttributeError, TypeError) as e:
        raise CheckpointError(
            f"checkpoint {str(root)!r} is damaged: {MANIFEST} is not a valid manifest ({e}). "
            "Fix: load an earlier complete checkpoint."
        ) from e
    return manifest


def verify_folder(root: str | os.PathLike, *, share: tuple[int, int] = (0, 1)) -> dict[str, Any]:
    """Raise CheckpointError (naming the file) unless `root` matches its manifest; return the manifest.

    `share=(i, n)`: hash only every n-th file starting at i (ranks split the hashing); names, sizes
    and the absence of extra files are checked in full by every caller.
    """
    root = Path(root)
    manifest = read_manifest(root)
    listed = manifest["files"]
    sealed = manifest.get("sealed", [])
    damaged = f"checkpoint {str(root)!r} is damaged or was tampered with"
    fix = "Fix: restore the file or load an earlier complete checkpoint (trainer.resume=auto falls back itself)."
    extra = sorted(set(_listed_files(root, sealed)) - set(listed))
    if extra:
        raise CheckpointError(f"{damaged}: file {extra[0]!r} is not in {MANIFEST}; it is not read. {fix}")
    for i, (rel, entry) in enumerate(sorted(listed.items())):
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise CheckpointError(f"{damaged}: {MANIFEST} names {rel!r}, outside the folder. {fix}")
        file = root / rel
        if not file.is_file():
            raise CheckpointError(f"{damaged}: file {rel!r} listed in {MANIFEST} is missing. {fix}")
        if file.stat().st_size != entry["bytes"]:
            raise CheckpointError(
                f"{damaged}: file {rel!r} has {file.stat().st_size} bytes, {MANIFEST} says {entry['bytes']}. {fix}"
            )
        if i % share[1] == share[0] and sha256_file(file) != entry["sha256"]:
            raise CheckpointError(f"{damaged}: file {rel!r} does not match its sha256 in {MANIFEST}. {fix}")
    for sub in sealed:
        if sub in ("", ".", "..") or "/" in sub or f"{sub}/{MANIFEST}" not in listed:
            raise CheckpointError(f"{damaged}: {MANIFEST} names {sub!r} as a sealed sub-folder. {fix}")
        verify_folder(root / sub, share=share)
    return manifest


def swap_in(tmp: Path, final: Path) -> None:
    """Rename the complete folder `tmp` to `final`; an existing `final` is kept as `final.old` until then.
    A link at `final` or `final.old` is refused (never followed, moved or deleted)."""
    old = refuse_link(final.with_name(final.name + OLD_SUFFIX))
    if refuse_link(final).exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_path(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def _left_by_a_save(path: Path, names: str, suffix: str) -> bool:
    """`path` is a real folder (not a link) named `<name><suffix>`, `<name>` matching `names`."""
    return (
        re.fullmatch(f"({names}){suffix}", path.name) is not None and path.is_dir() and not path.is_symlink()
    )


def recover_parent(parent: Path, names: str) -> list[str]:
    """Finish interrupted swaps and delete interrupted saves under `parent`; returns what it did.

    Only what a save leaves is touched: real folders (never links) named `<name>.tmp[-PID]`, and
    `<name>.old` holding a manifest, where `<name>` matches the regular expression `names` (e.g.
    `step_\\d+`). A user's folder of another name or a `<name>.old` without a manifest is left alone.
    Only call this while no other process writes under `parent` (the run lock).
    """
    done: list[str] = []
    if not parent.is_dir():
        return done
    for p in sorted(parent.iterdir()):
        if _left_by_a_save(p, names, rf"{re.escape(TMP_MARK)}(-\d+)?"):
            shutil.rmtree(p, ignore_errors=True)
            done.append(f"removed the interrupted save {p.name}")
    for old in sorted(parent.iterdir()):
        if not _left_by_a_save(old, names, re.escape(OLD_SUFFIX)) or not (old / MANIFEST).is_file():
            continue
        final = old.with_name(old.name[: -len(OLD_SUFFIX)])
        if final.is_symlink() or (final.exists() and not final.is_dir()):
            done.append(f"left {old.name} alone: {final.name} is not a folder of the run")
        elif (final / MANIFEST).is_file():
            shutil.rmtree(old, ignore_errors=True)
            done.append(f"removed {old.name} (replaced by a complete {final.name})")
        else:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(old, final)
            done.append(f"restored {final.name} from {old.name} (its replacement was interrupted)")
    return done
