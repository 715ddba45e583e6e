"""Where a run resumes from: the newest intact checkpoint of the same run (its recipe unchanged but for
what may change on resume), the damaged ones passed over said in one line."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from tqdm.auto import tqdm

from draftsmith.train.checkpoint import (
    RESOLVED_RECIPE,
    CheckpointError,
    TrainingError,
    checkpoints_dir,
    damaged_files,
    incomplete_checkpoints,
    is_rng_state,
    latest_checkpoint,
    rng_state_problem,
)
from draftsmith.train.recipe import DataSection, TrainRecipe
from draftsmith.train.recipe_loader import RecipeError, to_tree

# Recipe keys a resumed run may change: they do not alter what the finished steps computed. The run is
# found at the current output_dir, so where it was written before (a moved or copied run, or the same
# place spelt differently: a trailing slash, ./, a relative path) does not matter; its data is compared
# by content (train/data_identity.py), so neither does where the data lies now.
RESUMABLE_CHANGES = (
    "output_dir",
    "data.prepared",
    "data.features",
    "train.max_steps",
    "train.max_minutes",
    "train.resume",
    "train.resume_inexact",
    "train.resume_new_data",
    "tracking.",
)


def check_resumable(recipe: TrainRecipe, output_dir: Path) -> None:
    """A resumed run must be the same run: only RESUMABLE_CHANGES may differ from the saved recipe."""
    saved_path = output_dir / RESOLVED_RECIPE
    if not saved_path.is_file():
        return
    saved, current = flatten_recipe(yaml.safe_load(saved_path.read_text())), flatten_recipe(to_tree(recipe))
    # a key newer than the saved run's draftsmith, at its default, keeps the behaviour that run had
    defaults = flatten_recipe(to_tree(TrainRecipe(output_dir="", data=DataSection(), drafter={})))
    for key in sorted(set(saved) | set(current)):
        if key.startswith(RESUMABLE_CHANGES) or saved.get(key) == current.get(key):
            continue
        if key not in saved and key in defaults and current.get(key) == defaults[key]:
            continue
        raise RecipeError(
            f"cannot resume {output_dir}: {key} was {saved.get(key)!r}, now {current.get(key)!r}; "
            f"only train.max_steps and tracking may change on resume (use another output_dir for a new run)"
        )


def flatten_recipe(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and not (prefix == "" and key in {"drafter", "loss"}):
            flat.update(flatten_recipe(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def starting_checkpoint(recipe: TrainRecipe, output_dir: Path, resume: bool, is_main: bool) -> Path | None:
    checkpoint = latest_checkpoint(output_dir)
    if checkpoint is not None and not resume:
        raise TrainingError(
            f"{output_dir} already holds checkpoints (last: {checkpoint.name}); pass --resume "
            "(or train.resume=true) to continue, or choose another output_dir"
        )
    if resume:
        check_resumable(recipe, output_dir)
        if checkpoint is None and is_main:
            tqdm.write(f"draftsmith: no complete checkpoint in {output_dir}; starting from step 0")
    return checkpoint


@dataclass
class ResumeCandidates:
    """Complete checkpoints a resume may still start from, newest first, and what was wrong with
    the ones passed over (reported in one line when an older one is used)."""

    older: list[Path]
    skipped: list[str] = field(default_factory=list)


def checkpoint_problem(checkpoint: Path, process_index: int, inexact: bool) -> tuple[str | None, bool]:
    """Why ``checkpoint`` cannot be resumed from (None if it can), and whether that is only its random
    states (which ``inexact`` accepts). Its files are verified against the sizes and sha256 recorded
    at save, so a truncated optimizer state or a half-copied weights file is caught before loading."""
    damaged = damaged_files(checkpoint)
    other = [problem for name, problem in damaged.items() if not is_rng_state(name)]
    if other:
        return other[0], False
    rng = next(iter(damaged.values()), None) or rng_state_problem(checkpoint, process_index)
    return (None, False) if rng is None or inexact else (rng, True)


def next_intact_checkpoint(candidates: ResumeCandidates, output_dir: Path, process_index: int, inexact: bool) -> Path:
    """The newest intact checkpoint among ``candidates`` (removed from it); a clear error when none is."""
    refusals: list[tuple[str, bool]] = []
    while candidates.older:
        checkpoint = candidates.older.pop(0)
        problem, rng_only = checkpoint_problem(checkpoint, process_index, inexact)
        if problem is None:
            return checkpoint
        refusals.append((problem, rng_only))
        candidates.skipped.append(problem)
    problem = refusals[0][0] if refusals else f"{output_dir} holds no complete checkpoint"
    if refusals and all(rng_only for _, rng_only in refusals):  # only their random states: exact resume impossible
        raise TrainingError(
            f"cannot resume exactly: {problem}; resume from an intact copy of the run, or pass --resume-inexact "
            "(train.resume_inexact=true) to continue with fresh random states"
        )
    raise CheckpointError(
        f"no intact checkpoint to resume {output_dir} from ({problem}); restore the run from a copy, or start "
        "again in another output_dir"
    )


def report_resume_point(checkpoint: Path, candidates: ResumeCandidates, output_dir: Path, inexact: bool) -> None:
    """One line each: half-written checkpoints ignored, damaged ones passed over, an inexact resume."""
    incomplete = incomplete_checkpoints(output_dir)
    if incomplete:
        tqdm.write(
            f"draftsmith: ignoring {', '.join(incomplete)} in {checkpoints_dir(output_dir)} "
            "(saves that did not finish)",
            file=sys.stderr,
        )
    if candidates.skipped:
        more = f" (and {len(candidates.skipped) - 1} newer damaged)" if len(candidates.skipped) > 1 else ""
        tqdm.write(
            f"draftsmith: warning: {candidates.skipped[-1]}{more}; resuming from the previous intact checkpoint "
            f"{checkpoint.name}",
            file=sys.stderr,
        )
        candidates.skipped.clear()
    damaged_rng = [problem for name, problem in damaged_files(checkpoint).items() if is_rng_state(name)]
    if inexact and (problem := next(iter(damaged_rng), None) or rng_state_problem(checkpoint, 0)):
        tqdm.write(f"draftsmith: warning: {problem}; resuming inexactly with fresh random states", file=sys.stderr)
