"""``draftsmith curves``: held-out figures of training runs against the tokens they trained on.

A data-scaling study trains one recipe on nested subsets of one prepared set (``data.train_samples``)
and compares the runs at equal tokens: where a curve flattens, more steps on that data buy nothing and
only more data helps. Each run's evaluations (``metrics.jsonl`` rows with ``eval/...`` and
``tokens_seen``) become one line, labelled by its training samples (``run_info.json``).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftsmith.core.errors import DraftsmithError
from draftsmith.core.io import OutputRules, atomic_directory, atomic_write_bytes, atomic_write_json
from draftsmith.train.checkpoint import read_run_info

CURVES_FILES = ("curves.json", "curves.md", "curves.png")
DEFAULT_METRIC = "eval/sim/accept_length"


class CurvesError(DraftsmithError, ValueError):
    """A run that holds no curve to plot."""


@dataclass
class Curve:
    run: str
    label: str
    points: list[tuple[int, float]]  # (tokens_seen, value), in training order

    def best(self) -> tuple[int, float]:
        return max(self.points, key=lambda point: point[1])

    def reached(self, goal: float) -> int | None:
        """The tokens trained on at the first evaluation at or above ``goal`` (None: not reached)."""
        return next((tokens for tokens, value in self.points if value >= goal), None)


def read_curve(run: Path, metric: str = DEFAULT_METRIC) -> Curve:
    """``metric`` at each evaluation of the run in ``run``, against the tokens trained on by then."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        raise CurvesError(f"{run} holds no metrics.jsonl; give the output_dir of a `draftsmith train` run")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    evaluated = [row for row in rows if metric in row]
    if not evaluated:
        raise CurvesError(f"{run} logged no {metric}; train with data.eval_samples > 0")
    if any("tokens_seen" not in row for row in evaluated):
        raise CurvesError(f"{run} logged {metric} without tokens_seen (trained before draftsmith recorded it)")
    by_step = {row["step"]: (int(row["tokens_seen"]), float(row[metric])) for row in evaluated}  # a resume repeats none
    return Curve(str(run), _label(run), [by_step[step] for step in sorted(by_step)])


def _label(run: Path) -> str:
    samples = read_run_info(run).get("train_samples")
    return f"{samples:,} training samples" if samples else run.name


def read_curves(runs: list[Path], metric: str = DEFAULT_METRIC) -> list[Curve]:
    """One curve per run; where the runs train different drafter families (a same-data comparison),
    each label starts with its family."""
    curves = [read_curve(run, metric) for run in runs]
    families = [read_run_info(run).get("family") for run in runs]
    if None not in families and len(set(families)) > 1:
        for curve, family in zip(curves, families, strict=True):
            curve.label = f"{family}, {curve.label}"
    return curves


def curves_markdown(curves: list[Curve], metric: str, goal: float | None = None) -> str:
    goal_column = f" tokens to reach {goal:g} |" if goal is not None else ""
    lines = [
        f"| run | label | evaluations | tokens at the last | last {metric} | best | tokens at the best |{goal_column}",
        "| --- | --- | --- | --- | --- | --- | --- |" + (" --- |" if goal is not None else ""),
    ]
    for curve in curves:
        (last_tokens, last), (best_tokens, best) = curve.points[-1], curve.best()
        row = (
            f"| `{curve.run}` | {curve.label} | {len(curve.points)} | {last_tokens:,} | {last:.3f} | {best:.3f} | "
            f"{best_tokens:,} |"
        )
        if goal is not None:
            reached = curve.reached(goal)
            row += f" {reached:,} |" if reached is not None else " not reached |"
        lines.append(row)
    return "\n".join(lines) + "\n"


def curves_png(curves: list[Curve], metric: str, goal: float | None = None) -> bytes:
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(7, 4.5))
    for curve in curves:
        tokens, values = zip(*curve.points)
        axis.plot([t / 1e6 for t in tokens], values, marker="o", markersize=3, label=curve.label)
    if goal is not None:
        axis.axhline(goal, color="grey", linestyle="--", linewidth=1, label=f"goal {goal:g}")
    axis.set_xlabel("tokens trained on (millions)")
    axis.set_ylabel(f"held-out {metric.removeprefix('eval/')}")
    axis.grid(alpha=0.3)
    axis.legend(loc="lower right")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120)
    plt.close(fig)
    return buffer.getvalue()


def is_curves_output(path: Path) -> bool:
    return (Path(path) / CURVES_FILES[0]).is_file()


def write_curves(
    runs: list[Path], out: Path, metric: str = DEFAULT_METRIC, overwrite: bool = False, goal: float | None = None
) -> list[Curve]:
    """curves.json, curves.md and curves.png in ``out``, all or none; with ``goal``, where each run reached it."""
    curves = read_curves([Path(run) for run in runs], metric)
    keep = tuple(("a run it plots", Path(run)) for run in runs)
    rules = OutputRules("curves written by `draftsmith curves`", is_curves_output, keep, writes=CURVES_FILES)
    with atomic_directory(Path(out), overwrite, rules) as staging:
        records: list[dict[str, Any]] = [{"run": c.run, "label": c.label, "points": c.points} for c in curves]
        summary: dict[str, Any] = {"metric": metric, "runs": records}
        if goal is not None:
            summary["goal"] = goal
            for record, curve in zip(records, curves, strict=True):
                record["reached_goal_at"] = curve.reached(goal)
        atomic_write_json(staging / CURVES_FILES[0], summary)
        atomic_write_bytes(staging / CURVES_FILES[1], curves_markdown(curves, metric, goal).encode())
        atomic_write_bytes(staging / CURVES_FILES[2], curves_png(curves, metric, goal))
    return curves


def cmd_curves(args: argparse.Namespace) -> None:
    curves = write_curves([Path(run) for run in args.runs], Path(args.out), args.metric, args.overwrite, args.goal)
    print(curves_markdown(curves, args.metric, args.goal), end="")
    print(f"wrote {args.out}/{CURVES_FILES[2]}")


def add_curves_command(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "curves",
        help="plot training runs' held-out acceptance against the tokens they trained on (data-scaling curves)",
        description="One line per run: its held-out figure at each checkpoint against tokens_seen, labelled by "
        "its training samples (and its drafter family, where the runs train different ones). Train the runs "
        "with data.eval_samples > 0 (and data.train_samples=N for nested subsets of one prepared set). Writes "
        "curves.png, curves.md and curves.json into --out.",
    )
    p.add_argument("runs", nargs="+", help="training runs' output_dir")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--metric", default=DEFAULT_METRIC, help=f"the logged held-out figure (default {DEFAULT_METRIC})")
    p.add_argument(
        "--goal",
        type=float,
        default=None,
        help="a value of the metric to aim at: drawn as a dashed line, and each run's table row says after how many "
        "tokens it first reached it (or that it did not)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace curves an earlier `draftsmith curves` wrote")
    p.set_defaults(func=cmd_curves, output_args=("out",))
