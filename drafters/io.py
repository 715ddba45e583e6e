"""Saving and loading a drafter's own weights: ``config.json`` + ``model.safetensors``, nothing of the target."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
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


def load_weights_into(model: nn.Module, directory: str | Path) -> list[str]:
    """Copy a drafter directory's weights into ``model`` (e.g. to start training from a finished run);
    returns the names of the tensors the directory lacks, which keep their values (a part added since,
    such as Speculative Streaming's pruning adapter). A tensor ``model`` has no place for, or one of
    another shape, means the two were built with different options."""
    path = Path(directory) / WEIGHTS_NAME
    if not path.is_file():
        raise DrafterCheckpointError(f"{directory} is not a drafter directory: {WEIGHTS_NAME} is missing")
    state, own = load_file(str(path)), model.state_dict()
    misfits = sorted(name for name, tensor in state.items() if name not in own or own[name].shape != tensor.shape)
    if misfits:
        raise DrafterCheckpointError(
            f"{path} does not fit this drafter ({', '.join(misfits[:3])}): use the options it was trained with"
        )
    model.load_state_dict(state, strict=False)
    return sorted(set(own) - set(state))


def write_directory_atomically(out: str | Path, write: Callable[[Path], None], overwrite: bool = False) -> Path:
    """Fill a temp directory beside ``out`` with ``write`` and rename it into place, so a crash never
    leaves a half-written directory and an existing one is replaced only when asked."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; pass --overwrite to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        write(staging)
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return out


def export_drafter(model: nn.Module, target_identity: dict[str, str], out: str | Path, overwrite: bool = False) -> Path:
    """The self-describing drafter directory: config (family, options, target identity) and weights,
    as the model's ``save_pretrained`` writes them (Medusa-2 adds its LoRA adapter in peft's format)."""
    model.config.target_identity = dict(target_identity)
    return write_directory_atomically(out, lambda staging: model.save_pretrained(staging), overwrite)


def export_speculators(model: nn.Module, verifier_name: str, out: str | Path, overwrite: bool = False) -> Path:
    """An EAGLE drafter in vLLM ``speculators`` layout (``config.json`` + ``model.safetensors``), for
    ``vllm serve TARGET --speculative-config '{"model": OUT, "method": "eagle", ...}'``."""
    from draftsmith.drafters.eagle import speculators_layout

    config, state = speculators_layout(model, verifier_name)

    def write(staging: Path) -> None:
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(state, str(staging / WEIGHTS_NAME), metadata={"format": "pt"})

    return write_directory_atomically(out, write, overwrite)
