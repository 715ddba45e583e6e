"""``draftsmith export``: a training run's checkpoint as a self-describing drafter directory.

The directory holds ``config.json`` (the family's config with ``drafter_family`` and the target's
identity) and ``model.safetensors`` (the drafter's own weights, nothing of the target), which
``inference/`` loads with one call and refuses for any other target. ``--format vllm|speculators|sglang``
writes a serving engine's layout instead, ``--format gguf`` llama.cpp's (``model.gguf``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from safetensors import safe_open

from draftsmith.core.io import check_creatable_directory, check_output_directory, verify_files
from draftsmith.core.target import (
    TargetIdentity,
    load_tokenizer,
    safetensors_directory,
    target_gguf_file,
    target_name,
)
from draftsmith.drafters.engine_layouts import ENGINE_FORMATS, EngineLayoutError, Verifier
from draftsmith.drafters.gguf_layout import GGUF_DTYPES, export_gguf
from draftsmith.drafters.io import (
    check_finite_weights,
    drafter_output_rules,
    export_drafter,
    export_for_engine,
    read_drafter_config,
)
from draftsmith.drafters.pretrained import ROOT, bundled_names
from draftsmith.drafters.registry import get_family
from draftsmith.train.checkpoint import (
    DRAFTER_DIR,
    RESOLVED_RECIPE,
    CheckpointError,
    complete_checkpoints,
    find_best_checkpoint,
    find_checkpoint,
    read_run_info,
    read_state,
)
from draftsmith.train.recipe import TrainRecipe
from draftsmith.train.recipe_loader import build

EMBEDDING = "model.embed_tokens.weight"


FORMATS = ("draftsmith", *ENGINE_FORMATS, "gguf")
# the precisions an export may store its weights in; the runtime computes in the target's dtype either way
STORAGE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# by format: the draftsmith layout's above, llama.cpp's GGUF (default float32); engine layouts keep the checkpoint's
DTYPES_BY_FORMAT = {"draftsmith": tuple(STORAGE_DTYPES), "gguf": GGUF_DTYPES}


def trained_precision(run_dir: Path) -> str:
    """The storage dtype matching the run's training: bfloat16 where its linears computed in bfloat16
    (``train.mixed_precision`` bf16, recorded in ``run_info.json``), else float32."""
    try:
        info = read_run_info(run_dir)
    except (OSError, ValueError):
        return "float32"
    return "bfloat16" if isinstance(info, dict) and info.get("mixed_precision") == "bf16" else "float32"


@dataclass(frozen=True)
class ExportLayout:
    """What an export is written as (``draftsmith export``'s ``--format``, ``--verifier``,
    ``--speculative-tokens`` and ``--dtype``). ``format`` other than ``draftsmith`` writes a serving
    engine's layout (``vllm``, ``speculators``, ``sglang``; see :mod:`draftsmith.drafters.engine_layouts`,
    or ``gguf``, llama.cpp's) for ``verifier`` (default: the target the drafter was trained for), which
    must be that target when it is a local model. ``dtype``: the precision the floating-point weights are
    stored in (:data:`DTYPES_BY_FORMAT`; None: the layout's default)."""

    format: str = "draftsmith"
    verifier: str | None = None
    speculative_tokens: int | None = None
    dtype: str | None = None


def export_run(
    run_dir: Path,
    out: Path,
    layout: ExportLayout = ExportLayout(),
    *,
    checkpoint: str | None = None,
    best: bool = False,
    overwrite: bool = False,
) -> Path:
    """Write the drafter of ``run_dir``'s last complete checkpoint (or ``checkpoint``, or with ``best``
    the one with the highest ``eval/sim/accept_length``) to ``out`` in ``layout``; draftsmith's own
    layout stores its weights as ``layout.dtype`` (:data:`STORAGE_DTYPES`; None: :func:`trained_precision`).
    A drafter's precision never touches losslessness (the target verifies every token); bfloat16 halves
    the bytes each draft reads. An engine layout's verifier defaults to the recipe's target."""
    run_dir = Path(run_dir)
    if layout.format not in FORMATS:
        raise CheckpointError(f"unknown export format {layout.format!r}; use one of {', '.join(FORMATS)}")
    check_storage_dtype(layout.format, layout.dtype)
    recipe_path = run_dir / RESOLVED_RECIPE
    exported = exported_drafter_source(run_dir) if not recipe_path.is_file() else None
    if exported is not None:
        if layout.format == "draftsmith" or checkpoint is not None or best:
            raise CheckpointError(
                f"{run_dir} is an exported drafter, not a training run: it has no checkpoints to choose from, and "
                "it is already in draftsmith's layout; give --format vllm, speculators, sglang or gguf to convert it"
            )
        return export_exported_drafter(exported, out, overwrite, layout)
    if not recipe_path.is_file():
        raise CheckpointError(
            f"{run_dir} is not a training run (no {RESOLVED_RECIPE}) nor an exported drafter; give the run's "
            f"output_dir, an export, or a shipped drafter's name ({', '.join(bundled_names()) or 'none shipped'})"
        )
    keep = (("the training run", run_dir),)
    check_output_directory(Path(out), overwrite, drafter_output_rules(keep))
    check_creatable_directory(Path(out))
    recipe = build(TrainRecipe, yaml.safe_load(recipe_path.read_text()))
    if best and checkpoint is not None:
        raise CheckpointError("give --checkpoint or --best, not both")
    source = find_best_checkpoint(run_dir) if best else find_checkpoint(run_dir, checkpoint)
    others = ", ".join(p.name for p in complete_checkpoints(run_dir) if p != source) or "none"
    rebuild = f"export another checkpoint with --checkpoint NAME (complete ones: {others})"
    verify_files(source, rebuild, required=True)
    state = read_state(source)
    family = get_family(state.get("family", recipe.family_name))
    model = family.model_class.from_pretrained(str(source / DRAFTER_DIR))
    model.config.drafter_family = family.name
    check_finite_weights(model.state_dict(), f"{source.name} of {run_dir}", rebuild, CheckpointError)
    if layout.format == "draftsmith":
        model = model.to(STORAGE_DTYPES[layout.dtype or trained_precision(run_dir)])
        return export_drafter(model, state["target_identity"], out, overwrite=overwrite, keep=keep)
    trained_for = state["target_identity"]
    return write_serving_layout(model, layout, trained_for, recipe.target.name, out, overwrite, keep)


def check_storage_dtype(fmt: str, dtype: str | None) -> None:
    """``--dtype`` is for the layouts that choose their precision (:data:`DTYPES_BY_FORMAT`)."""
    if dtype is None or dtype in DTYPES_BY_FORMAT.get(fmt, ()):
        return
    choices = "; ".join(f"{name}: {', '.join(dtypes)}" for name, dtypes in DTYPES_BY_FORMAT.items())
    raise CheckpointError(
        f"--dtype {dtype} with --format {fmt}: an export stores its weights as ({choices}); the other engine "
        "layouts keep the checkpoint's"
    )


def exported_drafter_source(path: Path) -> Path | None:
    """The exported drafter ``path`` names: a directory ``draftsmith export`` wrote, or a shipped drafter's
    folder name (``eagle3-smollm2``) when no such path exists; None when it is neither."""
    if not path.exists() and str(path) in bundled_names():
        return ROOT / str(path)
    config = path / "config.json"
    if config.is_file() and "drafter_family" in json.loads(config.read_text(encoding="utf-8")):
        return path
    return None


def export_exported_drafter(directory: Path, out: Path, overwrite: bool, layout: ExportLayout) -> Path:
    """An exported drafter (its files checked first) in a serving engine's layout, for ``layout.verifier``
    (default: the target it was exported for, by its embedded name where it has one)."""
    config = read_drafter_config(directory)
    family = get_family(config["drafter_family"])
    keep = (("the exported drafter", directory),)
    check_output_directory(Path(out), overwrite, drafter_output_rules(keep))
    check_creatable_directory(Path(out))
    model = family.model_class.from_pretrained(str(directory)).float()
    identity = config["target_identity"]
    return write_serving_layout(model, layout, identity, target_name(identity["name"]), out, overwrite, keep)


def write_serving_layout(
    model: torch.nn.Module,
    layout: ExportLayout,
    trained_for: dict[str, str],
    default_verifier: str,
    out: Path,
    overwrite: bool,
    keep: tuple[tuple[str, Path], ...],
) -> Path:
    """``model`` in the engine layout ``layout.format`` (llama.cpp's GGUF or a serving engine's), for
    ``layout.verifier`` or else ``default_verifier`` (GGUF: the target's own file, found from ``trained_for``)."""
    if layout.format == "gguf":
        return write_gguf_layout(
            model, layout.verifier, trained_for, layout.speculative_tokens, layout.dtype, out, overwrite, keep
        )
    verifier = layout.verifier or default_verifier
    return write_engine_layout(
        model, layout.format, verifier, trained_for, layout.speculative_tokens, out, overwrite, keep
    )


def write_engine_layout(
    model: torch.nn.Module,
    fmt: str,
    verifier: str,
    trained_for: dict[str, str],
    speculative_tokens: int | None,
    out: Path,
    overwrite: bool,
    keep: tuple[tuple[str, Path], ...],
) -> Path:
    """``model`` (trained for the target ``trained_for``) in serving engine layout ``fmt`` for ``verifier``;
    a family or option the layout cannot express is one line naming what ``keep`` says was exported."""
    try:
        engine_target = engine_verifier(verifier, trained_for)
        return export_for_engine(model, fmt, engine_target, speculative_tokens, trained_for, out, overwrite, keep)
    except EngineLayoutError as error:
        raise CheckpointError(f"cannot export {keep[0][1]} as {fmt}: {error}") from None


def write_gguf_layout(
    model: torch.nn.Module,
    verifier: str | None,
    trained_for: dict[str, str],
    speculative_tokens: int | None,
    dtype: str | None,
    out: Path,
    overwrite: bool,
    keep: tuple[tuple[str, Path], ...],
) -> Path:
    """``model`` as llama.cpp's GGUF for the target whose GGUF ``verifier`` names (default: the embedded
    target it was trained for), weights stored as ``dtype`` (default float32)."""
    try:
        path = target_gguf(verifier, trained_for)
        return export_gguf(model, path, speculative_tokens, dtype or "float32", trained_for, out, overwrite, keep)
    except EngineLayoutError as error:
        raise CheckpointError(f"cannot export {keep[0][1]} as gguf: {error}") from None


def target_gguf(verifier: str | None, trained_for: dict[str, str]) -> Path:
    """The target's GGUF file, whose tokenizer a GGUF drafter carries: ``verifier`` (a .gguf file or a named
    target), by default the named target the drafter was trained for."""
    name = verifier or target_name(trained_for["name"])
    path = target_gguf_file(name)
    if path is None:
        raise CheckpointError(
            f"a gguf export copies the target's tokenizer from its GGUF, and {name!r} is no named target; pass "
            "--verifier TARGET.gguf (the file llama.cpp serves the target from)"
        )
    return path


def engine_verifier(name: str, trained_for: dict[str, str]) -> Verifier:
    """The target an engine export names: its local safetensors directory when there is one (checked
    against the target the drafter was trained for, so an export for another target is refused), else
    the hub id as given (the engine fetches it; nothing here can check it)."""
    directory = safetensors_directory(name)
    if directory is None:
        return Verifier(name)
    _, identity = load_tokenizer(name)
    problem = TargetIdentity.from_dict(trained_for).mismatch(identity)
    if problem:
        raise CheckpointError(
            f"the drafter was trained for {trained_for['name']}, not the verifier {name}: {problem}; "
            "pass --verifier with the target it was trained for"
        )
    architectures = json.loads((directory / "config.json").read_text()).get("architectures") or ["LlamaForCausalLM"]
    return Verifier(str(directory), tuple(architectures), embed_tokens=lambda: read_embedding(directory))


def read_embedding(directory: Path) -> torch.Tensor:
    """The token embedding (``model.embed_tokens.weight``) from a safetensors model directory."""
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            if EMBEDDING in handle.keys():
                return handle.get_tensor(EMBEDDING).float()
    raise CheckpointError(f"{directory} holds no {EMBEDDING}; is it a Llama-architecture model?")


def drafter_parameter_counts(directory: Path) -> dict[str, int]:
    """An exported drafter's own parameters (the target's are not counted), by the kinds its model
    names in ``parameter_counts()`` (Speculative Streaming: streams, pruning, lora), else one total
    (e.g. Medusa's heads), so families can be put side by side."""
    family = get_family(read_drafter_config(Path(directory))["drafter_family"])
    return family.model_class.from_pretrained(str(directory)).parameter_counts()
