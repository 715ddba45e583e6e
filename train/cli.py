"""The ``draftsmith`` command: one entry point, one sub-command per job."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from draftsmith.data.cli import add_data_commands
from draftsmith.inference.cli import add_inference_commands
from draftsmith.train.commands import add_train_commands
from draftsmith.train.medusa_cli import add_medusa_commands
from draftsmith.train.quickstart import add_quickstart_command

# Jobs whose issues have not landed yet say so plainly instead of pretending to work.
PENDING: dict[str, tuple[str, str]] = {}


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors that are a user's mistake: printed as one line, never as a traceback."""
    from draftsmith.data.features import FeatureCacheError
    from draftsmith.data.formats import DataError
    from draftsmith.data.prepared import PreparedDataError
    from draftsmith.data.regenerate import RegenerateError
    from draftsmith.data.templates import TemplateError
    from draftsmith.drafters.eagle import EagleConfigError
    from draftsmith.drafters.io import DrafterCheckpointError
    from draftsmith.drafters.medusa import MedusaTreeError
    from draftsmith.drafters.medusa2 import Medusa2ConfigError
    from draftsmith.drafters.streaming import StreamingConfigError
    from draftsmith.inference.bench import BenchError
    from draftsmith.inference.methods import MethodError
    from draftsmith.inference.target import TargetError
    from draftsmith.train.checkpoint import CheckpointError
    from draftsmith.train.recipe import RecipeError
    from draftsmith.train.tracking import TrackingError
    from draftsmith.train.trainer import TrainingError

    return (
        TrainingError,
        EagleConfigError,
        MedusaTreeError,
        Medusa2ConfigError,
        StreamingConfigError,
        CheckpointError,
        TrackingError,
        DrafterCheckpointError,
        DataError,
        TargetError,
        MethodError,
        BenchError,
        TemplateError,
        PreparedDataError,
        FeatureCacheError,
        RegenerateError,
        RecipeError,
        FileExistsError,
        FileNotFoundError,
        IsADirectoryError,
        PermissionError,
    )


def _pending(name: str, what: str):
    def run(_args: argparse.Namespace) -> None:
        raise SystemExit(f"draftsmith {name}: not implemented yet; it arrives with {what}")

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="draftsmith",
        description="Train speculative-decoding drafters for a target LLM and decode losslessly with them.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_data_commands(commands)
    add_quickstart_command(commands)
    add_train_commands(commands)
    add_medusa_commands(commands)
    for name, (help_text, issue) in PENDING.items():
        commands.add_parser(name, help=f"{help_text} (not implemented yet)").set_defaults(func=_pending(name, issue))
    add_inference_commands(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    run_command(build_parser().parse_args(argv))


def run_command(args: argparse.Namespace) -> None:
    """Run a parsed command; a user's mistake becomes one line on stderr and exit status 2."""
    try:
        args.func(args)
    except _user_errors() as error:
        print(f"draftsmith: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        print("draftsmith: interrupted; rerun the same command to resume where supported", file=sys.stderr)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
