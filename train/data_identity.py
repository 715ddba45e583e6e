"""What data a run trained on, by content: resume continues only on the data the run started on.

A recipe names its prepared dataset and feature cache by path; the same path may hold other data later
(``data prepare OTHER --out P --overwrite``). A run records the sha256 of every file of both in
``run_info.json`` (``data``); ``--resume`` compares them with what the paths hold now and refuses other
data in one line naming what changed, unless ``--resume-new-data`` (``train.resume_new_data``) says to go
on, which ``run_info.json`` records under ``data_changes``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from draftsmith.core.io import IntegrityError, first_few, recorded_files, sha256_file
from draftsmith.train.recipe import DataSection

# The feature cache's manifest keys that change while `cache-features` still adds shards to it (a run may
# start on a cache being extended): its identity is everything else, and the shards it already held.
_GROWING_CACHE_KEYS = ("shards", "complete")


def data_identity(data: DataSection) -> dict[str, Any]:
    """The recipe's prepared dataset and feature cache, each as its path and its files' sha256."""
    identity = {"prepared": {"path": data.prepared, "files": _prepared_files(Path(data.prepared))}}
    if data.features:
        identity["features"] = {"path": data.features, "files": _cache_files(Path(data.features))}
    return identity


def _prepared_files(directory: Path) -> dict[str, str]:
    """The sha256 of each file, as its files.json records them (the dataset is checked against the record
    whenever it is opened), or read from the files where it records none (or a damaged record)."""
    try:
        entries = recorded_files(directory)
    except IntegrityError:
        entries = None
    if entries is not None:
        return {name: digest for name, (_, digest) in sorted(entries.items())}
    files = sorted(path for path in directory.rglob("*") if path.is_file()) if directory.is_dir() else []
    return {path.relative_to(directory).as_posix(): sha256_file(path) for path in files}


def _cache_files(directory: Path) -> dict[str, str]:
    """The sha256 of each shard the cache's manifest lists (checked when a shard is read), and one of its
    settings (target, dataset, dtype, layers, order) under ``manifest.json``."""
    try:
        manifest = json.loads((directory / "manifest.json").read_text(encoding="utf-8"))
        shards = {str(entry["file"]): str(entry["sha256"]) for entry in manifest.get("shards", [])}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}  # the run's own check of the cache says what is wrong with it
    settings = {key: value for key, value in manifest.items() if key not in _GROWING_CACHE_KEYS}
    settings["dataset"] = (manifest.get("dataset") or {}).get("fingerprint")  # not its path: data may move
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
    return {"manifest.json": digest, **shards}


def data_change(started: dict[str, Any], now: dict[str, Any]) -> str | None:
    """What differs between the data a run started on and what its paths hold now, in words, or None.
    A cache that gained shards since is the same cache; one that lost or changed any is not."""
    for part, option in (("prepared", "data.prepared"), ("features", "data.features")):
        before, after = started.get(part), now.get(part)
        if before is None and after is None:
            continue
        if before is None or after is None:
            return f"{option} was {_path(before)}, now {_path(after)}"
        changed = sorted(name for name, digest in before["files"].items() if after["files"].get(name) != digest)
        if part == "prepared":  # a prepared set that gained files is other data too
            changed += sorted(set(after["files"]) - set(before["files"]))
        if changed:
            return f"{option} {after['path']} holds other data than the run started on ({first_few(changed)} changed)"
    return None


def _path(part: dict[str, Any] | None) -> str:
    return "none" if part is None else str(part["path"])
