"""``python -m draftsmith.train RECIPE [key=value ...] [--resume]``: the entry for ``accelerate launch``."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from draftsmith.core.command_line import OneLineErrorParser, interrupted, parse_command_line, run_command


def main(argv: Sequence[str] | None = None) -> None:
    try:  # Ctrl-C while torch and transformers import: one line, as for `draftsmith`
        from draftsmith.train.commands import add_train_arguments, cmd_train

        parser = OneLineErrorParser(
            prog="accelerate launch -m draftsmith.train", description="Train a drafter from a YAML recipe."
        )
        add_train_arguments(parser)
        args = parse_command_line(parser, sys.argv[1:] if argv is None else argv)
    except KeyboardInterrupt:
        interrupted()
    args.func = cmd_train
    run_command(args)


if __name__ == "__main__":
    main(sys.argv[1:])
