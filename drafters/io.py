"""Saving and loading a drafter's own weights: ``config.json`` + ``model.safetensors``, nothing of the target."""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_file, save_file
from torch import nn

WEIGHTS_NAME = "model.safetensors"


class DrafterCheckpointError(ValueError):
    """A drafter directory that is missing files or does not match its config."""


def save_drafter_weights(model: nn.Module, directory: str | Path) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(directory)
    state = {name: tensor.detach().contiguous().cpu() for name, tensor in model.state_dict().items()}
    save_file(state, str(directory / WEIGHTS_NAME), metadata={"format": "pt"})


def load_drafter_weights(cls: type[nn.Module], directory: str | Path) -> nn.Module:
    directory = Path(directory)
    for name in ("config.json", WEIGHTS_NAME):
        if not (directory / name).is_file():
            raise DrafterCheckpointError(f"{directory} is not a drafter checkpoint: {name} is missing")
    model = cls(cls.config_class.from_pretrained(directory))
    missing, unexpected = model.load_state_dict(load_file(str(directory / WEIGHTS_NAME)), strict=False)
    if missing or unexpected:
        raise DrafterCheckpointError(
            f"{directory}/{WEIGHTS_NAME} does not match its config.json "
            f"(missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}); export it again"
        )
    return model


def export_drafter(model: nn.Module, target_identity: dict[str, str], out: str | Path, overwrite: bool = False) -> Path:
    """Write the self-describing drafter directory (config with family and target identity, weights)
    atomically: a temp directory renamed into place, so a crash never leaves a half-written export."""
    import shutil
    import tempfile

    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; pass --overwrite to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    model.config.target_identity = dict(target_identity)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_drafter_weights(model, staging)
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return out
