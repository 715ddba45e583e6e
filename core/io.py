"""Atomic writes: a reader (or a crash) never sees half a file or half a directory."""

from __future__ import annotations

import errno
import fnmatch
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from draftsmith.core.errors import DraftsmithError


class OutputDirectoryError(DraftsmithError, FileExistsError):
    """An ``--out`` that would overwrite, or lie within, something the command did not write."""


@dataclass(frozen=True)
class OutputRules:
    """What a command's ``--out`` may replace: only a directory its own earlier run wrote (``is_own``
    says so from the marker that run left, described by ``what``), never one that is, holds or lies
    inside one of the ``keep`` paths (its inputs, a training run)."""

    what: str  # e.g. "a prepared dataset written by `draftsmith data prepare`"
    is_own: Callable[[Path], bool]
    keep: tuple[tuple[str, Path], ...] = ()  # (what it is, path), e.g. ("the input", Path("d.jsonl"))
    # the files (fnmatch patterns, relative) the command writes, beside those its files.json records: an
    # output written before files were recorded, or one (bench results) that records none
    writes: tuple[str, ...] = ()


def overlap(dest: Path, kept: Path) -> str | None:
    """How ``dest`` overlaps ``kept`` ("is", "contains", "lies inside"), compared by resolved path."""
    dest, kept = dest.resolve(), kept.resolve()
    if dest == kept:
        return "is"
    if kept.is_relative_to(dest):
        return "contains"
    if dest.is_relative_to(kept):
        return "lies inside"
    return None


def check_apart_from_inputs(dest: Path, keep: tuple[tuple[str, Path], ...], option: str = "--out") -> None:
    """Refuse an output that is, contains or lies inside one of ``keep`` (what it is, path): writing it
    would replace or bury the command's own input."""
    for what, kept in keep:
        relation = overlap(Path(dest), Path(kept))
        if relation:
            raise OutputDirectoryError(f"{option} {dest} {relation} {what} {kept}; choose an {option} outside it")


def check_output_directory(dest: Path, overwrite: bool, rules: OutputRules | None = None) -> None:
    """Refuse, before any work, an ``--out`` whose replacement would delete what this command did not
    write: an input or run (always), a file, a non-empty directory without ``overwrite``, and with it
    one that does not look like this command's own output. ``rules=None`` replaces only empty ones."""
    dest = Path(dest)
    check_apart_from_inputs(dest, rules.keep if rules else ())
    if not dest.exists():
        return
    if not dest.is_dir():
        raise OutputDirectoryError(f"--out {dest} is a file, not a directory; choose another --out")
    if not any(dest.iterdir()):
        return
    if rules is not None and not rules.is_own(dest):  # checked first, so the fix offered is never --overwrite
        raise OutputDirectoryError(
            f"--out {dest} is not empty and is not {rules.what}; choose another --out "
            "(--overwrite never deletes what the command did not write)"
        )
    foreign = files_not_written_by(dest, rules) if rules is not None else []
    if foreign:  # replacing the directory would delete them: the user's notes kept beside the results
        raise OutputDirectoryError(
            f"--out {dest} holds files that are not part of {rules.what} ({first_few(foreign)}); move them out of "
            "it or choose another --out (--overwrite never deletes what the command did not write)"
        )
    if not overwrite:
        raise OutputDirectoryError(f"{dest} already exists and is not empty; choose another --out or pass --overwrite")
    if rules is None:
        raise OutputDirectoryError(f"{dest} already exists and is not empty; choose another --out")


def first_few(names: list[str], shown: int = 3) -> str:
    """``a, b, c and 4 more``: the names a one-line message can hold."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def check_output_file(
    dest: Path,
    overwrite: bool,
    what: str,
    is_own: Callable[[Path], bool],
    keep: tuple[tuple[str, Path], ...] = (),
    option: str = "--out",
) -> None:
    """The rule of :func:`check_output_directory` for a command that writes one file (an index, a tree):
    never an input; an existing file only with ``overwrite`` and only if it is ``what`` (``is_own``)."""
    dest = Path(dest)
    check_apart_from_inputs(dest, keep, option)
    if not dest.exists() and not dest.is_symlink():
        return
    if dest.is_dir():
        raise OutputDirectoryError(f"{option} {dest} is a directory; name the file to write, e.g. {dest}/out")
    if not dest.is_file():
        raise OutputDirectoryError(f"{option} {dest} is not a regular file (a pipe?); choose another {option}")
    if not is_own(dest):  # checked first, so the fix offered is never --overwrite
        raise OutputDirectoryError(
            f"{option} {dest} exists and is not {what}; choose another {option} "
            "(--overwrite never replaces what the command did not write)"
        )
    if not overwrite:
        raise OutputDirectoryError(f"{dest} already exists; choose another {option} or pass --overwrite")


def files_not_written_by(dest: Path, rules: OutputRules) -> list[str]:
    """The entries under ``dest`` (relative paths; an empty folder ends in ``/``) that are neither files its
    files.json vouches for nor one of the files ``rules`` says the command writes: what replacing ``dest``
    would lose. A record vouches for a file only where its size and sha256 are the file's: a files.json
    that lists the user's ``index.html`` with another digest (forged, or copied from elsewhere) does not
    make it the command's."""
    dest = Path(dest)
    try:
        recorded = recorded_files(dest) or {}
    except IntegrityError:  # a damaged record vouches for nothing: only the command's own names count
        recorded = {}
    own = {FILES_MANIFEST} | {name for name, entry in recorded.items() if _is_as_recorded(dest / name, entry)}
    foreign = []
    for path in sorted(dest.rglob("*")):
        name = path.relative_to(dest).as_posix()
        if path.is_dir() and not path.is_symlink():
            if not any(path.iterdir()):
                foreign.append(name + "/")
        elif name not in own and not any(_names(name, pattern) for pattern in rules.writes):
            foreign.append(name + (f" (not as {FILES_MANIFEST} records it)" if name in recorded else ""))
    return foreign


def _is_as_recorded(path: Path, entry: tuple[int, str]) -> bool:
    """Whether ``path`` is a regular file of the recorded (size, sha256); the size first, as it costs nothing."""
    size, digest = entry
    return path.is_file() and path.stat().st_size == size and sha256_file(path) == digest


# What the writing commands leave beside an output while they write it: a lock, a staging directory, the
# earlier output moved aside, a file being written (core/lock.py and the atomic writes below).
_WRITING_LEFTOVERS = (".*.draftsmith-lock", ".*.tmp-*", ".*.old", "*.tmp")


def check_working_directory(dest: Path, what: str, names: tuple[str, ...], option: str = "--out") -> None:
    """The output rule for a command that fills a folder with the outputs of its steps, each written by a
    command of its own and resumed when run again (``quickstart``): the folder may be new, empty, or hold
    only those outputs (``names``, fnmatch patterns of its entries), never the user's other files, which the
    steps would mix with; refused before any work, naming them."""
    dest = Path(dest)
    if not dest.exists():
        return
    if not dest.is_dir():
        raise OutputDirectoryError(f"{option} {dest} is a file, not a directory; choose another {option}")
    patterns = (*names, *_WRITING_LEFTOVERS)
    foreign = sorted(
        entry.name for entry in dest.iterdir() if not any(fnmatch.fnmatchcase(entry.name, p) for p in patterns)
    )
    if foreign:
        raise OutputDirectoryError(
            f"{option} {dest} holds files that are not part of {what} ({first_few(foreign)}); choose another "
            f"{option} (its steps never write beside what they did not write)"
        )


def _names(name: str, pattern: str) -> bool:
    """Whether ``pattern`` names the relative path ``name``, folder by folder (``*`` never spans a ``/``)."""
    return name.count("/") == pattern.count("/") and fnmatch.fnmatchcase(name, pattern)


def check_creatable_directory(dest: Path, inside: bool = False, option: str = "--out", fix: str = "") -> None:
    """Fail now, not after hours of work, if ``dest`` could not be written by :func:`atomic_directory`:
    its nearest existing ancestor must be a directory in which we can create (and remove) an entry.
    With ``inside`` (a directory written in place, such as a training run), an existing ``dest`` itself
    must take new entries. ``fix``: what to do instead (default: choose another ``option``)."""
    fix = fix or f"choose another {option}"
    dest = Path(dest)
    # the staging directory and the final rename happen in dest's parent
    candidates = [dest.absolute(), *dest.absolute().parents] if inside else list(dest.absolute().parents)
    ancestor = next(p for p in candidates if p.exists())
    if not ancestor.is_dir():
        raise OutputDirectoryError(f"{option} {dest} cannot be created: {ancestor} is a file; {fix}")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".draftsmith-probe-", dir=ancestor))
    except OSError as error:
        problem = f"{error.strerror} in {ancestor}"
        raise OutputDirectoryError(f"{option} {dest} cannot be written ({problem}); {fix}") from None


def jsonl_lines(text: str) -> list[str]:
    """The lines of JSON Lines text. Only a newline ends a line: ``str.splitlines`` also cuts at
    U+2028, U+0085 and the like, which JSON writers leave unescaped inside strings (``ensure_ascii=False``)."""
    return [line.removesuffix("\r") for line in text.split("\n")]


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary file beside ``path``, fsync, then rename over it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode())


def staging_directory(dest: Path) -> Path:
    """A fresh hidden directory beside ``dest`` to fill before :func:`publish_directory` (same file
    system, so the final rename is atomic)."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))


def publish_directory(staging: Path, dest: Path) -> None:
    """Rename a filled ``staging`` directory to ``dest``; an existing ``dest`` is moved aside first and
    deleted only once the new one is in place, so a crash leaves one of the two complete."""
    dest = Path(dest)
    if not dest.exists():
        os.rename(staging, dest)
        return
    old = dest.with_name(f".{dest.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    os.rename(dest, old)
    os.rename(staging, dest)
    shutil.rmtree(old, ignore_errors=True)


# Write failures that are the disk's, not the program's: a full disk, a quota, a read-only file system.
# safetensors and torch report them in their own exception types, so their words are matched too.
_DISK_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EDQUOT}
_DISK_WORDS = ("No space left on device", "Read-only file system", "Disk quota exceeded")


class OutputWriteError(DraftsmithError, OSError):
    """A write that failed for lack of room or a read-only disk; what was there before is intact."""


def disk_fix(reason: str) -> str:
    """What frees a write the disk refused for ``reason`` (:func:`disk_failure`): room on a full disk or
    quota, write access on a read-only one (where freeing space would not help)."""
    return "make it writable" if reason == os.strerror(errno.EROFS) or "Read-only" in reason else "free space"


def disk_failure(error: BaseException) -> str | None:
    """Why ``error`` says the disk refused a write (e.g. "No space left on device"), or None."""
    if isinstance(error, OSError) and error.errno in _DISK_ERRNOS:
        return error.strerror or os.strerror(error.errno)
    text = str(error)
    found = next((words for words in _DISK_WORDS if words in text), None)
    if found is None and "PytorchStreamWriter failed writing file" in text:  # torch.save's words for a short write
        return "a file could not be written in full (disk full?)"
    return found


@contextmanager
def atomic_directory(
    dest: Path, overwrite: bool = False, rules: OutputRules | None = None, record_files: bool = False
) -> Iterator[Path]:
    """Yield a staging directory that replaces ``dest`` only if the block finishes; the one way every
    artifact directory (prepared data, exports, bench results, the target cache) is written. What
    ``dest`` may replace is decided by :func:`check_output_directory` with ``rules``; ``record_files``
    adds :data:`FILES_MANIFEST` (size and sha256 of every file) for :func:`verify_files`."""
    dest = Path(dest)
    check_output_directory(dest, overwrite, rules)
    staging = staging_directory(dest)
    try:
        yield staging
        if record_files:
            write_files_manifest(staging)
        publish_directory(staging, dest)
    except Exception as error:
        reason = disk_failure(error)
        if reason is None:
            raise
        kept = f"the earlier {dest} is intact" if dest.exists() else "nothing was written"
        raise OutputWriteError(
            f"writing {dest} failed ({reason}); {kept}: {disk_fix(reason)} or choose another --out, and run again"
        ) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


# ---- integrity of artifact directories -------------------------------------------------------------

FILES_MANIFEST = "files.json"  # {"format", "files": {relative path: {"size", "sha256"}}}
FILES_FORMAT = "draftsmith.files/1"


class IntegrityError(DraftsmithError, ValueError):
    """An artifact file that is missing, truncated or changed since its directory was written."""


def describe_files(root: Path) -> dict[str, dict[str, Any]]:
    """Size and sha256 of every file under ``root`` (but the files manifest itself), by relative path."""
    root = Path(root)
    return {
        path.relative_to(root).as_posix(): {"size": path.stat().st_size, "sha256": sha256_file(path)}
        for path in sorted(root.rglob("*"))
        if path.is_file() and path.name != FILES_MANIFEST
    }


def write_files_manifest(root: Path) -> None:
    atomic_write_json(Path(root) / FILES_MANIFEST, {"format": FILES_FORMAT, "files": describe_files(root)})


def is_plain_relative_name(root: Path, name: str) -> bool:
    """Whether a recorded file name names a file inside ``root``: relative, no ``..``, no ``\\``, and not
    leading out through a symbolic link (a hostile files.json must not make us read /etc/passwd)."""
    parts = PurePosixPath(name).parts
    if not name or "\\" in name or "\0" in name or PurePosixPath(name).is_absolute():
        return False
    if any(part in ("..", ".") for part in parts):
        return False
    root = Path(root).resolve()
    return (root / name).resolve().is_relative_to(root)


def recorded_files(root: Path) -> dict[str, tuple[int, str]] | None:
    """The (size, sha256) :data:`FILES_MANIFEST` records for each file of ``root``, or None when it
    records nothing (an artifact from before files were recorded). :class:`IntegrityError` when the
    manifest is damaged or names a file outside ``root``."""
    manifest_path = Path(root) / FILES_MANIFEST
    if not manifest_path.is_file():
        return None
    try:
        recorded = json.loads(manifest_path.read_text(encoding="utf-8"))["files"]
        entries = {str(name): (int(entry["size"]), str(entry["sha256"])) for name, entry in recorded.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise IntegrityError(f"{manifest_path} is damaged") from None
    outside = next((name for name in entries if not is_plain_relative_name(root, name)), None)
    if outside is not None:
        raise IntegrityError(f"{manifest_path} names {outside!r}, which is not a file inside {root} (edited?)")
    return entries


def record_rewritten_file(root: Path, name: str) -> None:
    """After a command rewrote ``root/name`` in place (e.g. a calibrated tree in an export's config),
    record its new size and sha256, so the directory still verifies."""
    manifest_path = Path(root) / FILES_MANIFEST
    if not manifest_path.is_file():  # an artifact from before files were recorded stays unrecorded
        return
    manifest = json.loads(manifest_path.read_text())
    path = Path(root) / name
    manifest["files"][name] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
    atomic_write_json(manifest_path, manifest)


def file_problems(root: Path, hashes: bool = True, required: bool = False) -> dict[str, str]:
    """What is wrong with each recorded file of ``root`` (by relative path): missing, another size, or
    (with ``hashes``) other bytes. Empty when all is well, or when nothing was recorded and the record is
    not ``required`` (an artifact written before files were recorded is read as it is)."""
    root = Path(root)
    try:
        entries = recorded_files(root)
    except IntegrityError as error:
        return {FILES_MANIFEST: str(error)}
    if entries is None and required:
        return {FILES_MANIFEST: f"{root / FILES_MANIFEST} is missing, so none of its files can be checked"}
    if entries is None:
        return {}
    problems = {}
    for name, (size, digest) in entries.items():
        path = root / name
        if not path.is_file():
            problems[name] = f"{path} is missing"
        elif (actual := path.stat().st_size) != size:
            problems[name] = f"{path} has {actual:,} bytes, {size:,} when written (truncated or replaced)"
        elif hashes and sha256_file(path) != digest:
            problems[name] = f"{path} is damaged (its sha256 differs from the one recorded when it was written)"
    return problems


def verify_files(
    root: Path,
    rebuild: str,
    hashes: bool = True,
    error: type[DraftsmithError] = IntegrityError,
    required: bool = False,
) -> None:
    """Raise ``error`` naming the first damaged file of ``root`` and ``rebuild``, the fix."""
    problems = file_problems(root, hashes, required)
    if problems:
        raise error(f"{next(iter(problems.values()))}; {rebuild}")
