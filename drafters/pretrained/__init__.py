"""Drafters shipped with the package, one exported directory each (``config.json``, weights, model
card), served by ``--method NAME`` without a directory when the target is the one it was trained for."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from draftsmith.core.target import TargetIdentity

ROOT = Path(__file__).resolve().parent


def bundled_drafters(root: Path | None = None) -> list[Path]:
    """Every shipped drafter directory."""
    root = ROOT if root is None else root
    return sorted(path.parent for path in root.glob("*/config.json"))


def _bundled_configs(root: Path | None = None) -> Iterator[tuple[Path, dict[str, Any]]]:
    """Every shipped drafter directory with its ``config.json``."""
    for directory in bundled_drafters(root):
        yield directory, json.loads((directory / "config.json").read_text(encoding="utf-8"))


def bundled_drafter(families: set[str], identity: TargetIdentity | None, root: Path | None = None) -> Path | None:
    """The shipped drafter of one of ``families`` trained for the target ``identity``, if there is one."""
    for directory, config in _bundled_configs(root):
        trained_for = TargetIdentity.from_dict(config["target_identity"])
        if config.get("drafter_family") in families and identity is not None and not trained_for.mismatch(identity):
            return directory
    return None


def bundled_families_for(target_name: str, root: Path | None = None) -> list[str]:
    """The families of the drafters shipped for the target recorded under ``target_name`` (an identity's
    name), without loading it: what ``--method FAMILY`` serves once the target's identity matches."""
    return [
        config["drafter_family"]
        for _, config in _bundled_configs(root)
        if config["target_identity"].get("name") == target_name
    ]


def bundled_names(root: Path | None = None) -> list[str]:
    """The shipped drafters' folder names (e.g. ``eagle3-smollm2``), for messages."""
    return [directory.name for directory in bundled_drafters(root)]
