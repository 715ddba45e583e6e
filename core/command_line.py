"""Running a parsed command as every draftsmith entry point does (``draftsmith``, ``accelerate launch -m
draftsmith.train``): a user's mistake is one ``draftsmith: error:`` line and exit status 2, Ctrl-C one line
and 130, and what a command writes is locked against a second writer. It imports nothing heavy, so the
entry points can use it before torch loads."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import NoReturn

from draftsmith.core.errors import DraftsmithError
from draftsmith.core.io import disk_failure, disk_fix
from draftsmith.core.malloc import keep_freed_memory

# A user's mistake: printed as one line, never as a traceback. Every draftsmith error derives from
# DraftsmithError, so a new family's errors need no entry here.
USER_ERRORS: tuple[type[BaseException], ...] = (
    DraftsmithError,
    FileExistsError,
    FileNotFoundError,
    IsADirectoryError,
    PermissionError,
)


class OneLineErrorParser(argparse.ArgumentParser):
    """A bad command line is one ``draftsmith: error:`` line naming the option, like every other user
    error (argparse would print the whole usage first); sub-command parsers inherit the class."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"draftsmith: error: {message} (see `{self.prog} --help`)\n")


def parse_command_line(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """``parser.parse_args(argv)``, but a command's ``KEY=VALUE`` overrides may also follow its options
    (``train RECIPE --resume train.max_steps=50``): argparse fills a positional list once, so it would call
    the later ones unrecognized arguments."""
    args, extras = parser.parse_known_args(argv)
    late = [item for item in extras if hasattr(args, "overrides") and "=" in item and not item.startswith("-")]
    unknown = [item for item in extras if item not in late]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if late:
        args.overrides = [*args.overrides, *late]
    return args


def interrupted() -> NoReturn:
    """Ctrl-C, at any moment of a command: one line and exit status 130 (128 + SIGINT), no traceback."""
    print("draftsmith: interrupted; rerun the same command to resume where supported", file=sys.stderr)
    raise SystemExit(130) from None


def run_command(args: argparse.Namespace) -> None:
    """Run a parsed command; a user's mistake becomes one line on stderr and exit status 2."""
    keep_freed_memory()
    try:
        with _exclusive_output(args):
            args.func(args)
    except USER_ERRORS as error:
        user_error(str(error))
    except OSError as error:  # a write the disk refused outside an atomic artifact (e.g. appending a log)
        if disk_failure(error) is None:
            raise
        reason = disk_failure(error)
        user_error(
            f"{reason} writing {error.filename or 'a file'}; files already complete were kept (each is written "
            f"to a temporary copy first): {disk_fix(reason)} and run the command again"
        )
    except KeyboardInterrupt:
        interrupted()


def user_error(message: str) -> NoReturn:
    """Exit with status 2 after one ``draftsmith: error:`` line. Under torchrun (``accelerate launch`` of
    several processes) every rank meets the same error: rank 0 alone prints it, and each rank hands it to
    the launcher through its error file, so the launcher's failure summary shows the line (a rank's own
    error included) instead of a pointer to tracebacks."""
    line = f"draftsmith: error: {message}"
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        with contextlib.suppress(OSError):
            Path(error_file).write_text(json.dumps({"message": line, "timestamp": int(time.time())}))
    if not error_file or os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr)
    raise SystemExit(2) from None


def _exclusive_output(args: argparse.Namespace) -> AbstractContextManager[None]:
    """The lock of what the command writes: the first of its ``output_args`` (set by its parser) that was
    given, so that two commands never write one output at once. ``train`` locks its output_dir itself."""
    from draftsmith.core.lock import exclusive_output

    for name in getattr(args, "output_args", ()):
        value = getattr(args, name, None)
        if value:
            return exclusive_output(Path(value), "--out" if name == "out" else name.upper())
    return nullcontext()
