"""Training checkpoints: full state, written atomically, found by their completion marker.

Layout of ``OUTPUT_DIR/checkpoints/step-N``::

    COMPLETE                 written last: a directory without it is never used
    files.json               size and sha256 of every other file, written just before COMPLETE: a
                             resume verifies them and falls back to the previous intact checkpoint
    trainer_state.json       step, epoch, data position, world size, global batch, target identity,
                             and ``eval``: the held-out metrics at this step (empty without eval samples)
    drafter/                 config.json + model.safetensors (what `draftsmith export` reads)
    ...                      accelerate's state: weights (or the DeepSpeed engine's files), optimizer,
                             scheduler, RNG states of python / numpy / torch for every rank

Every rank writes its part into ``checkpoints/.tmp-step-N``; after a barrier the main process adds
the marker and renames the directory to ``step-N``, then deletes all but the last ``keep_last``
complete ones and the best one (the highest :data:`BEST_METRIC`, which ``draftsmith export --best``
takes). A crash at any point leaves the previous complete checkpoint untouched.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from draftsmith.core.errors import DraftsmithError
from draftsmith.core.io import (
    atomic_write_json,
    disk_failure,
    disk_fix,
    file_problems,
    publish_directory,
    write_files_manifest,
)
from draftsmith.drafters.io import save_drafter_weights

MARKER = "COMPLETE"
STATE_FILE = "trainer_state.json"
RESOLVED_RECIPE = "recipe.resolved.yaml"  # the run's recipe, file + overrides + defaults, beside its checkpoints
RUN_INFO = "run_info.json"  # the run's layout and precision (Trainer.run_info), beside its checkpoints
DRAFTER_DIR = "drafter"
RNG_STATE_KEYS = ("random_state", "numpy_random_seed", "torch_manual_seed")  # what accelerate restores
# The held-out figure that ranks checkpoints, higher is better: the top-1 chain acceptance length every
# family's loss reports, the closest of the logged figures to decoding speed.
BEST_METRIC = "eval/sim/accept_length"
_NAME = re.compile(r"^step-(\d+)$")
_DELETING = ".deleting-"  # a checkpoint being deleted: renamed first, so it is never a step-N half gone


class TrainingError(DraftsmithError, RuntimeError):
    """Training cannot start or go on (non-finite loss, a run directory that does not fit)."""


class CheckpointError(DraftsmithError, RuntimeError):
    """A checkpoint that is missing, incomplete or does not fit the run."""


def read_run_info(run: Path) -> dict[str, Any]:
    """The run's ``run_info.json`` (:data:`RUN_INFO`; empty where the run has none)."""
    info = Path(run) / RUN_INFO
    return json.loads(info.read_text(encoding="utf-8")) if info.is_file() else {}


def checkpoints_dir(output_dir: Path) -> Path:
    return Path(output_dir) / "checkpoints"


def complete_checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first; temp directories and ones without the marker are ignored."""
    root = checkpoints_dir(output_dir)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _NAME.match(path.name)
        if match and path.is_dir() and (path / MARKER).is_file():
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def latest_checkpoint(output_dir: Path) -> Path | None:
    found = complete_checkpoints(output_dir)
    return found[-1] if found else None


def find_checkpoint(output_dir: Path, name: str | None) -> Path:
    """The named checkpoint (``step-N``) or the last complete one; a clear error when there is none. The
    name is looked up among the run's own complete checkpoints, never joined to a path: ``../../OTHER/
    checkpoints/step-2`` would export another run's checkpoint (of another family, perhaps) as this one's."""
    if name is None:
        path = latest_checkpoint(output_dir)
        if path is None:
            raise CheckpointError(f"{output_dir} holds no complete checkpoint (no checkpoints/step-N/{MARKER})")
        return path
    complete = {path.name: path for path in complete_checkpoints(output_dir)}
    if name not in complete:
        raise CheckpointError(
            f"--checkpoint {name!r} is not the name of a complete checkpoint of {output_dir}; complete ones: "
            f"{', '.join(complete) or 'none'}"
        )
    return complete[name]


def best_checkpoint(output_dir: Path) -> Path | None:
    """The complete checkpoint with the highest :data:`BEST_METRIC` (the later one on a tie); None
    when no checkpoint recorded it (a run without ``data.eval_samples``)."""
    scored = [(score, path) for path in complete_checkpoints(output_dir) if (score := eval_score(path)) is not None]
    return max(reversed(scored), key=lambda item: item[0])[1] if scored else None  # max keeps the first it sees


def eval_score(checkpoint: Path) -> float | None:
    """The checkpoint's recorded :data:`BEST_METRIC`, if any."""
    score = read_state(checkpoint).get("eval", {}).get(BEST_METRIC)
    return None if score is None else float(score)


def find_best_checkpoint(output_dir: Path) -> Path:
    """:func:`best_checkpoint`, or a clear error when no checkpoint was evaluated."""
    path = best_checkpoint(output_dir)
    if path is None:
        raise CheckpointError(
            f"no checkpoint of {output_dir} recorded {BEST_METRIC} (train with data.eval_samples > 0); "
            "export the last one without --best"
        )
    return path


def read_state(checkpoint: Path) -> dict[str, Any]:
    return json.loads((Path(checkpoint) / STATE_FILE).read_text())


def save_checkpoint(accelerator: Any, model: Any, output_dir: Path, state: dict[str, Any], keep_last: int) -> Path:
    """Write the full training state of step ``state['step']``; call on every rank. A save the disk
    refuses (full, read-only) removes its half-written directory and says which checkpoint is intact."""
    root = checkpoints_dir(output_dir)
    step = int(state["step"])
    tmp = root / f".tmp-step-{step}"
    try:
        return _save_checkpoint(accelerator, model, output_dir, state, keep_last)
    except Exception as error:
        reason = disk_failure(error)
        if reason is None:
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        previous = latest_checkpoint(output_dir)
        kept = f"the last complete checkpoint {previous.name} is intact" if previous else "no earlier checkpoint exists"
        raise CheckpointError(
            f"saving checkpoint step-{step} in {root} failed ({reason}); {kept}: {disk_fix(reason)} and rerun with "
            "--resume"
        ) from None


def _save_checkpoint(accelerator: Any, model: Any, output_dir: Path, state: dict[str, Any], keep_last: int) -> Path:
    root = checkpoints_dir(output_dir)
    step = int(state["step"])
    tmp, final = root / f".tmp-step-{step}", root / f"step-{step}"
    if accelerator.is_main_process:
        for leftover in (tmp, *root.glob(f"{_DELETING}step-*")):  # of an interrupted write or delete
            shutil.rmtree(leftover, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    weights = accelerator.get_state_dict(model)  # collective under ZeRO-3: every rank takes part
    if accelerator.is_main_process:
        save_drafter_weights(accelerator.unwrap_model(model), tmp / DRAFTER_DIR, weights)
        atomic_write_json(tmp / STATE_FILE, state)
        _fsync_tree(tmp)
        write_files_manifest(tmp)  # after the flush: what it records is what is on disk
        (tmp / MARKER).write_text(f"step {step}\n")
        publish_directory(tmp, final)  # the same step written again replaces it (a resumed run's final save)
        best = best_checkpoint(output_dir)
        for old in complete_checkpoints(output_dir)[:-keep_last]:
            if old != best:
                delete_checkpoint(old)
    accelerator.wait_for_everyone()
    return final


def delete_checkpoint(checkpoint: Path) -> None:
    """Remove a complete checkpoint. It is renamed out of the ``step-N`` names first: a crash in the middle
    of the delete then leaves a temp directory, never a ``step-N`` that keeps its marker but lost files,
    which the next save's search for the best checkpoint would read."""
    doomed = checkpoint.with_name(f"{_DELETING}{checkpoint.name}")
    shutil.rmtree(doomed, ignore_errors=True)  # a leftover of an interrupted delete
    os.rename(checkpoint, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def rng_state_file(checkpoint: Path, process_index: int) -> Path:
    """Where accelerate keeps one rank's python / numpy / torch random states in a checkpoint."""
    return Path(checkpoint) / f"random_states_{process_index}.pkl"


def rng_state_problem(checkpoint: Path, process_index: int) -> str | None:
    """Why this rank's random states cannot be restored, or None. accelerate itself skips a missing or
    damaged file with an INFO log, and the resumed run then silently stops matching an uninterrupted one."""
    from accelerate.utils import load

    path = rng_state_file(checkpoint, process_index)
    if not path.is_file():
        return f"{path} is missing"
    try:
        states = load(path)  # as accelerate loads it next: weights_only, so a hostile pickle runs no code
    except Exception as exc:  # any unpickling failure means the same: the file is damaged
        return f"{path} is unreadable ({type(exc).__name__})"
    if not isinstance(states, dict) or not all(key in states for key in RNG_STATE_KEYS):
        return f"{path} holds no random states"
    return None


def incomplete_checkpoints(output_dir: Path) -> list[str]:
    """Names of checkpoint directories a crash left half-written (no marker, or still a temp dir)."""
    root = checkpoints_dir(output_dir)
    if not root.is_dir():
        return []
    return sorted(
        path.name
        for path in root.iterdir()
        if path.is_dir()
        and (path.name.startswith(".tmp-step-") or _NAME.match(path.name))
        and not (path / MARKER).is_file()
    )


def damaged_files(checkpoint: Path) -> dict[str, str]:
    """The checkpoint's files that differ from what :data:`FILES_MANIFEST` recorded at save (size and
    sha256), by relative path; empty for an intact one. Every checkpoint records its files just before
    it is marked complete, so one without the record was tampered with: nothing in it is vouched for."""
    return file_problems(checkpoint, hashes=True, required=True)


def is_rng_state(name: str) -> bool:
    return re.fullmatch(r"random_states_\d+\.pkl", name) is not None


def load_checkpoint(accelerator: Any, checkpoint: Path) -> dict[str, Any]:
    """Restore weights, optimizer, scheduler and every rank's RNG states; returns the trainer state."""
    accelerator.load_state(str(checkpoint))
    return read_state(checkpoint)


def _fsync_tree(root: Path) -> None:
    """Flush every file before the marker is written, so the marker never outlives its data."""
    for path in root.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
