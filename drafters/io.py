"""A drafter's directory: ``config.json`` + ``model.safetensors`` (its own weights, nothing of the target).

Reading one (:func:`read_drafter_config`, :func:`check_drafter_target`) and writing one
(:func:`save_drafter_weights`, :func:`export_drafter`, :func:`export_for_engine`) for the trainer's
checkpoints, ``draftsmith export`` and the runtime's loader alike.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from draftsmith.core.errors import DraftsmithError
from draftsmith.core.io import FILES_MANIFEST, OutputRules, atomic_directory, sha256_file, verify_files
from draftsmith.core.target import Target, TargetError, TargetIdentity
from draftsmith.drafters.engine_layouts import Verifier, check_engine_export

WEIGHTS_NAME = "model.safetensors"
TUNED_TREES = "tuned_trees.json"  # the trees `draftsmith tune` fitted to devices, inside an export


class DrafterCheckpointError(DraftsmithError, ValueError):
    """A drafter directory that is missing files or does not match its config."""


def rebuild_export(directory: str | Path) -> str:
    return f"export it again: `draftsmith export RUN --out {directory} --overwrite`"


def load_weights_file(path: str | Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors, all finite; a truncated or garbled file is one line, not a
    SafetensorError."""
    try:
        tensors = load_file(str(path))
    except Exception as exc:  # safetensors raises its own error types (and OSError) for damaged files
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DrafterCheckpointError(f"{path} is damaged ({detail}); {rebuild_export(Path(path).parent)}") from None
    check_finite_weights(tensors, str(path), rebuild_export(Path(path).parent))
    return tensors


def check_finite_weights(
    tensors: dict[str, torch.Tensor],
    where: str,
    fix: str,
    error: type[DraftsmithError] = DrafterCheckpointError,
) -> None:
    """Refuse weights holding NaN or infinity (a diverged run, a damaged file): a drafter with them
    proposes garbage, or nothing, without a word."""
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise error(f"{where} holds non-finite weights ({name} has NaN or infinity); {fix}")


def check_vocabulary_indices(model: nn.Module, vocab_size: int, directory: str | Path) -> None:
    """Every token id a drafter stores (its ``stored_token_ids()``) lies in ``0..vocab_size-1``."""
    for name, buffer in model.stored_token_ids().items():
        if not buffer.numel():
            continue
        low, high = int(buffer.min()), int(buffer.max())
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise DrafterCheckpointError(
                f"{directory}: {name} holds token id {bad}, outside the target's vocabulary 0..{vocab_size - 1} "
                f"(the file is damaged); {rebuild_export(directory)}"
            )


def save_drafter_weights(model: nn.Module, directory: str | Path, state: dict[str, torch.Tensor] | None = None) -> None:
    """The model's config and its weights (``state``: gathered ones, e.g. under ZeRO-3; default its own)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(directory)
    state = model.state_dict() if state is None else state
    tensors = {name: tensor.detach().contiguous().cpu() for name, tensor in state.items()}
    save_file(tensors, str(directory / WEIGHTS_NAME), metadata={"format": "pt"})


def weight_count(model_class: Any, config: Any) -> int:
    """How many numbers (parameters and saved buffers) ``model_class(config)`` holds, counted on the meta
    device: nothing is allocated, so an absurd size costs nothing to measure."""
    with torch.device("meta"):
        skeleton = model_class(config)
    return sum(tensor.numel() for tensor in skeleton.state_dict().values())


def stored_weight_count(directory: Path) -> int:
    """How many numbers the safetensors files of a drafter directory hold, read from their headers alone."""
    from safetensors import safe_open

    total = 0
    for path in sorted(directory.glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt") as handle:
                total += sum(math.prod(handle.get_slice(name).get_shape()) for name in handle.keys())
        except Exception as exc:  # safetensors' own error types (and OSError) for a damaged file
            detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise DrafterCheckpointError(f"{path} is damaged ({detail}); {rebuild_export(directory)}") from None
    return total


def checked_config(cls: Any, directory: str | Path) -> Any:
    """A drafter directory's config, held to the same checks as a recipe's options: its tree indices
    (e.g. Medusa's choice paths, which index heads and their ranks) must fit before anything decodes, and
    the model it describes may hold no more numbers than the directory's weight files (an edited size,
    e.g. ``hidden_size`` 100000, is refused before many GB are allocated for it)."""
    stored = stored_weight_count(Path(directory))
    try:
        config = cls.config_class.from_pretrained(directory)
        config.check()
        needed = weight_count(cls, config)
    except (DraftsmithError, TypeError, ValueError, KeyError, AttributeError, RuntimeError) as error:  # hand-edited
        raise _invalid_config(directory, error) from None
    if needed > stored:
        detail = f"it describes a drafter of {needed:,} weights, its weight files hold {stored:,}"
        raise _invalid_config(directory, ValueError(detail))
    return config


def _invalid_config(directory: str | Path, error: BaseException) -> DrafterCheckpointError:
    detail = str(error).splitlines()[0] if str(error) else type(error).__name__
    return DrafterCheckpointError(f"{directory}/config.json is invalid ({detail}); {rebuild_export(directory)}")


def load_drafter_weights(cls: Any, directory: str | Path) -> nn.Module:
    directory = Path(directory)
    for name in ("config.json", WEIGHTS_NAME):
        if not (directory / name).is_file():
            raise DrafterCheckpointError(f"{directory} is not a drafter checkpoint: {name} is missing")
    config, weights = checked_config(cls, directory), load_weights_file(directory / WEIGHTS_NAME)
    try:
        model = cls(config)
        missing, unexpected = model.load_state_dict(weights, strict=False)
    except (TypeError, ValueError, KeyError, AttributeError, RuntimeError) as error:  # sizes edited, wrong types
        raise _invalid_config(directory, error) from None
    if missing or unexpected:
        raise DrafterCheckpointError(
            f"{directory}/{WEIGHTS_NAME} does not match its config.json "
            f"(missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}); export it again"
        )
    return model


def load_weights_into(
    model: nn.Module,
    directory: str | Path,
    adapt: Callable[[dict[str, torch.Tensor]], tuple[dict[str, torch.Tensor], list[str]]] | None = None,
) -> list[str]:
    """Copy a drafter directory's weights into ``model`` (e.g. to start training from a finished run);
    returns the names of the tensors the directory lacks, which keep their values (a part added since,
    such as Speculative Streaming's pruning adapter). A tensor ``model`` has no place for, or one of
    another shape, means the two were built with different options. ``adapt`` may first fit the
    directory's tensors to ``model`` (returning them and what starts fresh in them)."""
    path = Path(directory) / WEIGHTS_NAME
    if not path.is_file():
        raise DrafterCheckpointError(f"{directory} is not a drafter directory: {WEIGHTS_NAME} is missing")
    state, own = load_weights_file(path), model.state_dict()
    lacking = sorted(set(own) - set(state))
    adapted: list[str] = []
    if adapt is not None:
        state, adapted = adapt(state)
    misfits = sorted(name for name, tensor in state.items() if name not in own or own[name].shape != tensor.shape)
    if misfits:
        raise DrafterCheckpointError(
            f"{path} does not fit this drafter ({', '.join(misfits[:3])}): use the options it was trained with"
        )
    model.load_state_dict(state, strict=False)
    return lacking + adapted


def read_drafter_config(directory: str | Path) -> dict[str, Any]:
    """The ``config.json`` of an exported drafter, which names its family; every file the export
    recorded is checked first (size and sha256: its weights are about to be loaded)."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise DrafterCheckpointError(
            f"{directory} is not an exported drafter (no config.json); make one with `draftsmith export`"
        )
    verify_files(Path(directory), rebuild_export(directory))
    if not (Path(directory) / FILES_MANIFEST).is_file():
        _warn_once(
            f"{directory} records no {FILES_MANIFEST} (exported before files were recorded), so its files are not "
            f"checked; {rebuild_export(directory)}"
        )
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise DrafterCheckpointError(f"{path} is not valid JSON ({exc.msg}); export the drafter again") from None
    if not isinstance(config, dict) or "drafter_family" not in config:
        raise DrafterCheckpointError(f"{path} names no drafter_family; it was not written by `draftsmith export`")
    return config


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    """One warning line per process, however often the drafter is loaded (bench loads it per method)."""
    if message not in _warned:
        _warned.add(message)
        print(f"draftsmith: warning: {message}", file=sys.stderr)


def check_drafter_target(config: dict[str, Any], target: Target, directory: str | Path) -> None:
    """Refuse a drafter trained for another target: its features and token ids would mean nothing here."""
    recorded = config.get("target_identity")
    if not recorded:
        raise DrafterCheckpointError(f"{directory} records no target identity; export it with `draftsmith export`")
    problem = TargetIdentity.from_dict(recorded).mismatch(target.identity)
    if problem:
        raise TargetError(
            f"drafter {directory} was trained for {recorded['name']}, not this target: {problem}; "
            "pass the target it was trained for with --target, or train a drafter for this one"
        )


def is_exported_drafter(path: Path) -> bool:
    """Whether ``path`` holds what ``draftsmith export`` writes, in any format (its config.json names a
    drafter family, or records an engine export; older exports: a speculators model type; a GGUF export:
    its record in the file)."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return is_gguf_export(Path(path))
    return isinstance(config, dict) and any(
        key in config for key in ("drafter_family", ENGINE_EXPORT_KEY, "speculators_model_type")
    )


def is_gguf_export(path: Path) -> bool:
    """Whether ``path`` holds a ``--format gguf`` export: a GGUF file carrying draftsmith's record."""
    from draftsmith.drafters.gguf_layout import GGUF_FILE, read_gguf_record  # it writes with this module

    return (path / GGUF_FILE).is_file() and read_gguf_record(path / GGUF_FILE) is not None


# What an export (of any family or format) writes, for one made before its files were recorded; `tune`
# adds tuned_trees.json.
EXPORT_WRITES = ("config.json", "*.safetensors", "adapter_config.json", "generation_config.json", TUNED_TREES)


def drafter_output_rules(keep: tuple[tuple[str, Path], ...] = ()) -> OutputRules:
    """``--out`` of ``draftsmith export`` replaces only an exported drafter, never one of ``keep``."""
    return OutputRules("a drafter written by `draftsmith export`", is_exported_drafter, keep, EXPORT_WRITES)


def export_drafter(
    model: nn.Module,
    target_identity: dict[str, str],
    out: str | Path,
    overwrite: bool = False,
    keep: tuple[tuple[str, Path], ...] = (),
) -> Path:
    """The self-describing drafter directory: config (family, options, target identity) and weights,
    as the model's ``save_pretrained`` writes them (Medusa-2 adds its LoRA adapter in peft's format)."""
    model.config.target_identity = dict(target_identity)
    with atomic_directory(Path(out), overwrite, drafter_output_rules(keep), record_files=True) as staging:
        model.save_pretrained(staging)
        keep_tuned_trees(Path(out), staging)
    return Path(out)


def keep_tuned_trees(earlier: Path, staging: Path) -> None:
    """Carry the earlier export's tuned_trees.json into its replacement when the weights it was fitted
    for are the same bytes (an export run again of the same checkpoint): the trees still hold, and
    fitting them again takes minutes."""
    fitted = earlier / TUNED_TREES
    old, new = earlier / WEIGHTS_NAME, staging / WEIGHTS_NAME
    if fitted.is_file() and old.is_file() and new.is_file() and sha256_file(old) == sha256_file(new):
        shutil.copy2(fitted, staging / TUNED_TREES)


ENGINE_EXPORT_KEY = "draftsmith_export"  # config.json key of engine exports: family, format, target identity


def export_for_engine(
    model: Any,
    fmt: str,
    verifier: Verifier,
    speculative_tokens: int | None,
    target_identity: dict[str, str],
    out: str | Path,
    overwrite: bool = False,
    keep: tuple[tuple[str, Path], ...] = (),
) -> Path:
    """The drafter in a serving engine's layout (``config.json`` + ``model.safetensors`` + the layout's
    other files, e.g. DFlash's ``mask_embedding.pt``), after
    checking that the config holds every field the engine requires; the config also records, under
    :data:`ENGINE_EXPORT_KEY`, the family, format and target identity (engines ignore the key)."""
    export = model.engine_layout(fmt, verifier, speculative_tokens)
    check_engine_export(export, fmt)
    record = {
        "family": model.config.drafter_family,
        "format": fmt,
        "speculative_tokens": export.speculative_tokens,
        "target_identity": dict(target_identity),
        **({"caveat": export.caveat} if export.caveat else {}),
    }
    config = {**export.config, ENGINE_EXPORT_KEY: record}
    with atomic_directory(Path(out), overwrite, drafter_output_rules(keep), record_files=True) as staging:
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(export.tensors, str(staging / WEIGHTS_NAME), metadata={"format": "pt"})
        for name, data in export.files.items():
            (staging / name).write_bytes(data)
    return Path(out)


def read_engine_export(directory: str | Path) -> dict[str, Any] | None:
    """What :func:`export_for_engine` recorded in ``directory`` (family, format, target identity), or
    None when ``directory`` holds no engine export."""
    try:
        config = json.loads((Path(directory) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    record = config.get(ENGINE_EXPORT_KEY) if isinstance(config, dict) else None
    return record if isinstance(record, dict) else None
