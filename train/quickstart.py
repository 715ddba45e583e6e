"""``draftsmith quickstart``: the whole product on the embedded default, as the commands a user would type.

Prepare the bundled data, cache the target's features, train an FSPAD drafter for a small step
budget, export it, fit its draft tree to this machine (``draftsmith tune``, on held-out calibration
prompts) and benchmark it, with the fitted tree and with the recipe's, against plain decoding and
prompt lookup and the drafter shipped for the target on other held-out prompts.
Each step prints the ``draftsmith`` command it runs, so the quickstart doubles as a tutorial, and
each step resumes: rerunning after an interruption continues where it stopped.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from draftsmith.core.arguments import thread_count
from draftsmith.core.io import atomic_write_bytes
from draftsmith.data.default_prompts import held_out_questions


def _run(build_parser: Callable[[], argparse.ArgumentParser], argv: list[str]) -> None:
    print(f"\n==> draftsmith {' '.join(argv)}", flush=True)
    args = build_parser().parse_args(argv)
    args.func(args)


def _prepared_exists(path: Path) -> bool:
    from draftsmith.data.prepared import PreparedDataError, PreparedDataset

    try:
        PreparedDataset(path)
    except (PreparedDataError, FileNotFoundError, OSError, ValueError, KeyError):
        return False
    return True


def _write_questions(path: Path, questions: list[dict[str, Any]]) -> None:
    atomic_write_bytes(path, "".join(json.dumps(q) + "\n" for q in questions).encode())


def _recipe_tree(export: Path) -> str:
    """The tree the drafter was trained with, as serve-time options (the bench shows it beside the fitted one)."""
    config = json.loads((export / "config.json").read_text())
    return ":".join(f"{key}={config[key]}" for key in ("depth", "top_k", "total_tokens"))


def _shipped_methods() -> list[str]:
    """The drafters the package ships for the embedded target (``--method eagle3`` without a directory),
    benched beside the one the quickstart trains, with the tree fitted for them on this kind of CPU."""
    from draftsmith.core.target import embedded_target
    from draftsmith.drafters.pretrained import bundled_families_for

    return bundled_families_for(embedded_target(None).display_name)


def cmd_quickstart(args: argparse.Namespace) -> None:
    from draftsmith.train.checkpoint import latest_checkpoint
    from draftsmith.train.recipe_loader import shipped_recipes

    out = Path(args.out)
    prepared, features, run, export = out / "prepared", out / "features", out / "fspad", out / "fspad-drafter"
    if not _prepared_exists(prepared):
        _run(args.build_parser, ["data", "prepare", "--out", str(prepared), "--overwrite"])
    _run(args.build_parser, ["data", "cache-features", str(prepared), "--out", str(features)])
    train = [
        "train",
        str(shipped_recipes() / "fspad-smollm2.yaml"),
        f"output_dir={run}",
        f"data.prepared={prepared}",
        f"data.features={features}",
        f"train.max_steps={args.steps}",
        f"tracking.wandb={'true' if args.wandb else 'false'}",
    ]
    _run(args.build_parser, train + (["--resume"] if latest_checkpoint(run) is not None else []))
    _run(args.build_parser, ["export", str(run), "--out", str(export), "--overwrite"])
    threads = ["--threads", str(args.threads)] if args.threads else []
    held_out = held_out_questions(args.questions_per_category)
    questions, calibration = out / "questions.jsonl", out / "calibration.jsonl"
    _write_questions(questions, held_out)
    # tune calibrates on other new prompts than the bench's, so the table measures a tree fitted elsewhere
    _write_questions(calibration, held_out_questions(1, seed=2, exclude=(q["turns"][0] for q in held_out)))
    tune = ["tune", str(export), "--questions", str(calibration), "--max-new-tokens", str(args.max_new_tokens)]
    _run(args.build_parser, tune + ["--top-k", "1,2,4"] + threads)
    methods = ",".join(["pld", f"fspad={export}", f"fspad={export}:{_recipe_tree(export)}", *_shipped_methods()])
    bench = ["bench", "--questions", str(questions), "--methods", methods]
    bench += ["--max-new-tokens", str(args.max_new_tokens), "--out", str(out / "bench"), "--overwrite"]
    _run(args.build_parser, bench + threads)
    print(
        f"\nDone. The drafter is in {export}; try it:\n"
        f'  draftsmith generate "Explain how a rainbow forms." --method fspad={export}\n'
        f"Train longer with the same command and a larger --steps (it resumes), or run the full recipe:\n"
        f"  draftsmith train recipes/fspad-smollm2.yaml\n"
        f"The drafter shipped for SmolLM2 (trained on a GPU) needs no directory:\n"
        f'  draftsmith generate "Explain how a rainbow forms." --method eagle3',
        file=sys.stderr,
    )


def add_quickstart_command(subparsers: Any, build_parser: Callable[[], argparse.ArgumentParser]) -> None:
    """``build_parser`` gives the whole ``draftsmith`` parser, whose commands the quickstart runs."""
    p = subparsers.add_parser(
        "quickstart",
        help="train, export and benchmark an FSPAD drafter for the embedded SmolLM2 (about 7 minutes on 2 CPU cores)",
        description="Prepare the bundled data, cache SmolLM2's features, train an FSPAD drafter for --steps "
        "steps, export it and print a bench table (tau, speedup, identical outputs) against plain "
        "decoding, prompt lookup and the drafter shipped for SmolLM2 on held-out prompts. Every step resumes "
        "when rerun.",
    )
    p.add_argument("--out", default="runs/quickstart", help="working directory (default: runs/quickstart)")
    p.add_argument("--steps", type=int, default=120, help="training steps (default 120, ~1.5 minutes on 2 cores)")
    p.add_argument("--questions-per-category", type=int, default=1, help="held-out bench prompts per category")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=thread_count, default=None, help="torch threads for the bench, 1 to the cores")
    p.add_argument("--wandb", action="store_true", help="also log to W&B (offline without network: WANDB_MODE=offline)")
    p.set_defaults(func=cmd_quickstart, build_parser=build_parser, output_args=("out",))
