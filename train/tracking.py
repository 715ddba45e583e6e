"""Where training metrics go: the console, ``OUTPUT_DIR/metrics.jsonl`` and Weights & Biases.

Only the main process logs. W&B follows ``tracking.wandb_mode`` or else ``$WANDB_MODE`` (``offline``
writes the run under ``$WANDB_DIR`` or the output directory, to ``wandb sync`` later); the run id is
kept in the output directory, so a resumed run continues the same W&B run.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from draftsmith.core.errors import DraftsmithError
from draftsmith.core.io import atomic_write_bytes
from draftsmith.train.recipe import TrackingSection

METRICS_FILE = "metrics.jsonl"
WANDB_ID_FILE = "wandb_run_id.txt"


class TrackingError(DraftsmithError, RuntimeError):
    """A tracker that cannot start (e.g. W&B online without credentials)."""


def format_metrics(step: int, metrics: dict[str, float]) -> str:
    parts = [f"step {step}"]
    for key, value in metrics.items():
        parts.append(f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}")
    return " | ".join(parts)


def _step_of(line: str) -> int | None:
    """The step of one metrics record, None for a line that is not one (e.g. half-written by a crash)."""
    try:
        record = json.loads(line)
        return int(record["step"])
    except (ValueError, KeyError, TypeError):
        return None


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Drop records after ``last_step``: a resumed run rewrites them, so the file stays one curve. A line
    a crash left half-written is dropped too, and said in one line."""
    if not path.is_file():
        return
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    steps = [_step_of(line) for line in lines]
    torn = sum(step is None for step in steps)
    if torn:
        tqdm.write(
            f"draftsmith: dropped {torn} unreadable line(s) of {path} (a write cut off by a crash)", file=sys.stderr
        )
    kept = [line for line, step in zip(lines, steps) if step is not None and step <= last_step]
    atomic_write_bytes(path, "".join(line + "\n" for line in kept).encode())


class Tracker:
    """Console + JSONL + optional W&B; every method is a no-op off the main process."""

    def __init__(
        self, settings: TrackingSection, output_dir: Path, config: dict[str, Any], is_main: bool, start_step: int
    ) -> None:
        self.is_main = is_main
        self.output_dir = Path(output_dir)
        self.jsonl = self.output_dir / METRICS_FILE if settings.jsonl else None
        self.wandb_run = None
        if not is_main:
            return
        if self.jsonl is not None:
            truncate_jsonl(self.jsonl, start_step)
        if settings.wandb:
            self.wandb_run = _start_wandb(settings, self.output_dir, config)

    def log(self, step: int, metrics: dict[str, float], console: bool = True) -> None:
        if not self.is_main:
            return
        if console:
            tqdm.write(format_metrics(step, metrics))
        if self.jsonl is not None:
            with open(self.jsonl, "a") as handle:
                handle.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log(metrics, step=step)

    def close(self) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None


def _start_wandb(settings: TrackingSection, output_dir: Path, config: dict[str, Any]) -> Any:
    import wandb

    mode = settings.wandb_mode or os.environ.get("WANDB_MODE") or "online"
    id_file = output_dir / WANDB_ID_FILE
    run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:8]
    atomic_write_bytes(id_file, (run_id + "\n").encode())
    try:
        return wandb.init(
            project=settings.project,
            name=settings.run_name or output_dir.resolve().name,
            id=run_id,
            resume="allow",
            mode=mode,
            dir=os.environ.get("WANDB_DIR") or str(output_dir),
            config=config,
        )
    except Exception as exc:  # wandb raises its own error types for login/network problems
        raise TrackingError(
            f"W&B could not start ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
            "run `wandb login`, set WANDB_MODE=offline, or pass tracking.wandb=false"
        ) from None
