"""The ``draftsmith`` command: one entry point, one sub-command per job (the command table)."""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence

from draftsmith.core.command_line import OneLineErrorParser, interrupted, parse_command_line, run_command

# This module imports nothing heavy: torch and transformers load while the parser is built, inside
# main()'s handling of Ctrl-C, so an interrupt in a command's first seconds is one line too.


def build_parser() -> argparse.ArgumentParser:
    from draftsmith.cli.curves import add_curves_command
    from draftsmith.cli.medusa import add_medusa_commands
    from draftsmith.cli.quickstart import add_quickstart_command
    from draftsmith.data.cli import add_data_commands
    from draftsmith.inference.cli import add_inference_commands
    from draftsmith.train.commands import add_train_commands
    from draftsmith.train.recipe import recipe_cache_layers

    parser = OneLineErrorParser(
        prog="draftsmith",
        description="Train speculative-decoding drafters for a target LLM and decode losslessly with them.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_data_commands(commands, recipe_layers=recipe_cache_layers)
    add_quickstart_command(commands, build_parser)
    add_train_commands(commands)
    add_curves_command(commands)
    add_medusa_commands(commands)
    add_inference_commands(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    try:  # Ctrl-C while torch and transformers import (building the parser) or while parsing: one line
        argv = list(sys.argv[1:] if argv is None else argv)
        args = parse_command_line(build_parser(), argv)
        args.command_line = "draftsmith " + shlex.join(argv)  # what a run's records say made them
    except KeyboardInterrupt:
        interrupted()
    run_command(args)


if __name__ == "__main__":
    main()
