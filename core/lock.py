"""One writer per output: a command that writes a directory or file holds a lock beside it.

The lock is a file ``.NAME.draftsmith-lock`` in the output's parent (beside it, not in it: an atomic
output replaces its whole directory), created with ``O_CREAT | O_EXCL`` so that of two commands started
together exactly one gets it. It records the owner's pid and host; a lock whose owner died (killed,
power cut) is stale and taken over, and one held by a live process refuses the second writer in one
line naming the first.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from draftsmith.core.errors import DraftsmithError

LOCK_SUFFIX = ".draftsmith-lock"
# A lock file created but not yet filled in (its owner is between open() and write()) is young; an
# empty one older than this was left by a process that died in that instant.
_FILLING_SECONDS = 10.0


class OutputInUseError(DraftsmithError, RuntimeError):
    """An output another draftsmith command is writing now."""


def lock_path(dest: Path) -> Path:
    """Where the lock of ``dest`` lies, the same for every spelling of ``dest`` (``run``, ``./run/``)."""
    dest = Path(dest).resolve()
    return dest.parent / f".{dest.name}{LOCK_SUFFIX}"


@contextmanager
def exclusive_output(dest: Path, option: str = "--out") -> Iterator[None]:
    """Hold the lock of ``dest`` for the block; :class:`OutputInUseError` if a live process holds it.
    Where no lock can be created (the parent is a file or read-only) the block runs unlocked: the
    command's own checks refuse such an output, in the words that name the real problem."""
    path = lock_path(dest)
    held = _acquire(path, Path(dest), option)
    try:
        yield
    finally:
        if held:
            path.unlink(missing_ok=True)


def _acquire(path: Path, dest: Path, option: str) -> bool:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    for _ in range(5):  # each round either takes the lock or clears one stale owner
        try:
            descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            owner = _read_owner(path)
            if _is_alive(owner, path):
                raise OutputInUseError(_in_use_message(dest, owner, option, path)) from None
            _remove_stale(path, owner)
            continue
        except OSError:  # read-only or not a directory: nothing can be written there, lock or not
            return False
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            json.dump(_owner_record(), handle)
        return True
    raise OutputInUseError(f"{dest} is being claimed by several commands at once; run one of them at a time")


def _owner_record() -> dict[str, Any]:
    return {"pid": os.getpid(), "host": socket.gethostname(), "command": " ".join(sys.argv)[:300]}


def _read_owner(path: Path) -> dict[str, Any] | None:
    """The lock's record, or None while it is empty or unreadable."""
    try:
        owner = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) and isinstance(owner.get("pid"), int) else None


def _is_alive(owner: dict[str, Any] | None, path: Path) -> bool:
    """Whether the lock's owner may still be writing: its process exists, or it lives on another host
    (whose processes we cannot see), or the lock is being filled in right now."""
    if owner is None:
        try:
            return time.time() - path.stat().st_mtime < _FILLING_SECONDS
        except FileNotFoundError:
            return False
    if owner.get("host") != socket.gethostname():
        return True
    if owner["pid"] <= 0:  # os.kill would signal a process group, not ask after one process
        return False
    try:
        os.kill(owner["pid"], 0)
    except (ProcessLookupError, OverflowError, ValueError):  # no such process (or no pid any can have)
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def _remove_stale(path: Path, owner: dict[str, Any] | None) -> None:
    """Delete a dead owner's lock, but not a live lock that replaced it since we read it: it is moved
    aside first (atomic), checked, and put back if it is not the one we judged stale."""
    aside = path.with_name(f"{path.name}.stale-{os.getpid()}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:  # another command cleared it first
        return
    if _read_owner(aside) == owner:
        aside.unlink(missing_ok=True)
        return
    try:
        os.link(aside, path)  # fails if a third command took the lock meanwhile: then it holds it
    except OSError:
        pass
    aside.unlink(missing_ok=True)


def _in_use_message(dest: Path, owner: dict[str, Any] | None, option: str, path: Path) -> str:
    if owner is None:
        who = "another draftsmith command (starting now)"
    else:
        command = f": `{owner['command']}`" if owner.get("command") else ""
        host = f" on {owner['host']}" if owner.get("host") != socket.gethostname() else ""
        who = f"another draftsmith command (pid {owner['pid']}{host}{command})"
    return (
        f"{option} {dest} is being written by {who}; wait for it to finish or choose another {option} "
        f"(if no such command runs, delete {path})"
    )
