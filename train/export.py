"""``draftsmith export``: a training run's checkpoint as a self-describing drafter directory.

The directory holds ``config.json`` (the family's config with ``drafter_family`` and the target's
identity) and ``model.safetensors`` (the drafter's own weights, nothing of the target), which
``inference/`` loads with one call and refuses for any other target.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from draftsmith.core.errors import DraftsmithError
from draftsmith.core.io import check_creatable_directory, check_output_directory, verify_files
from draftsmith.drafters.io import drafter_output_rules, export_drafter, export_speculators, read_drafter_config
from draftsmith.drafters.registry import get_family
from draftsmith.train.checkpoint import (
    DRAFTER_DIR,
    RESOLVED_RECIPE,
    CheckpointError,
    complete_checkpoints,
    find_best_checkpoint,
    find_checkpoint,
    read_state,
)
from draftsmith.train.recipe import TrainRecipe
from draftsmith.train.recipe_loader import build


def export_run(
    run_dir: Path,
    out: Path,
    checkpoint: str | None = None,
    overwrite: bool = False,
    layout: str = "draftsmith",
    verifier: str | None = None,
    best: bool = False,
) -> Path:
    """Write the drafter of ``run_dir``'s last complete checkpoint (or ``checkpoint``, or with ``best``
    the one with the highest ``eval/sim/accept_length``) to ``out``.

    ``layout="speculators"`` writes vLLM's ``speculators`` EAGLE layout instead (plain EAGLE only),
    naming ``verifier`` (default: the recipe's target) as the model it drafts for."""
    run_dir = Path(run_dir)
    recipe_path = run_dir / RESOLVED_RECIPE
    if not recipe_path.is_file():
        raise CheckpointError(f"{run_dir} is not a training run (no {RESOLVED_RECIPE}); give the run's output_dir")
    keep = (("the training run", run_dir),)
    check_output_directory(Path(out), overwrite, drafter_output_rules(keep))
    check_creatable_directory(Path(out))
    recipe = build(TrainRecipe, yaml.safe_load(recipe_path.read_text()))
    if best and checkpoint is not None:
        raise CheckpointError("give --checkpoint or --best, not both")
    source = find_best_checkpoint(run_dir) if best else find_checkpoint(run_dir, checkpoint)
    others = ", ".join(p.name for p in complete_checkpoints(run_dir) if p != source) or "none"
    verify_files(source, f"export another checkpoint with --checkpoint NAME (complete ones: {others})")
    state = read_state(source)
    family = get_family(state.get("family", recipe.family_name))
    model = family.model_class.from_pretrained(str(source / DRAFTER_DIR))
    model.config.drafter_family = family.name
    if layout == "speculators":
        try:
            return export_speculators(model, verifier or recipe.target.name, out, overwrite=overwrite, keep=keep)
        except DraftsmithError as error:  # a family or option the layout cannot express
            raise CheckpointError(f"cannot export {run_dir} for speculators: {error}") from None
    return export_drafter(model, state["target_identity"], out, overwrite=overwrite, keep=keep)


def drafter_parameter_counts(directory: Path) -> dict[str, int]:
    """An exported drafter's own parameters (the target's are not counted), by the kinds its model
    names in ``parameter_counts()`` (Speculative Streaming: streams, pruning, lora), else one total
    (e.g. Medusa's heads), so families can be put side by side."""
    family = get_family(read_drafter_config(Path(directory))["drafter_family"])
    return family.model_class.from_pretrained(str(directory)).parameter_counts()
