"""Loading a trained drafter exported by ``draftsmith export`` and checking it fits the target."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from draftsmith.inference.target import Target, TargetError, TargetIdentity


def read_drafter_config(directory: Path) -> dict[str, Any]:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise TargetError(f"{directory} is not an exported drafter (no config.json); make one with `draftsmith export`")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise TargetError(f"{path} is not valid JSON ({exc.msg}); export the drafter again") from None
    if "drafter_family" not in config:
        raise TargetError(f"{path} names no drafter_family; it was not written by `draftsmith export`")
    return config


def check_drafter_target(config: dict[str, Any], target: Target, directory: Path) -> None:
    """Refuse a drafter trained for another target: its features and token ids would mean nothing here."""
    recorded = config.get("target_identity")
    if not recorded:
        raise TargetError(f"{directory} records no target identity; export it with `draftsmith export`")
    problem = TargetIdentity.from_dict(recorded).mismatch(target.identity)
    if problem:
        raise TargetError(
            f"drafter {directory} was trained for {recorded['name']}, not this target: {problem}; "
            "pass the target it was trained for with --target, or train a drafter for this one"
        )


def load_drafter(directory: str | Path, target: Target, expect: str | None = None, **tree: Any):
    """The runtime drafter for an exported directory; ``expect`` names the family the user asked for."""
    from draftsmith.train.families import FAMILIES

    directory = Path(directory)
    config = read_drafter_config(directory)
    family = config["drafter_family"]
    if family not in FAMILIES:
        raise TargetError(f"{directory} holds a {family!r} drafter, which this draftsmith does not know")
    entry = FAMILIES[family]
    method = entry.method or family  # a variant (medusa2) is served by its base method (medusa=DIR)
    if expect is not None and method != expect:
        raise TargetError(f"{directory} holds a {family!r} drafter, not {expect!r}; use --method {method}={directory}")
    check_drafter_target(config, target, directory)
    model = entry.model_class.from_pretrained(directory).to(target.model.device, target.model.dtype)
    return entry.serve(model, target.model, **tree)
