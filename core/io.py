"""Atomic writes: a reader (or a crash) never sees half a file or half a directory."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


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


@contextmanager
def atomic_directory(dest: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a staging directory that replaces ``dest`` only if the block finishes; the one way every
    artifact directory (prepared data, exports, the target cache) is written."""
    dest = Path(dest)
    if dest.exists() and any(dest.iterdir()) and not overwrite:
        raise FileExistsError(f"{dest} already exists and is not empty; choose another --out or pass --overwrite")
    staging = staging_directory(dest)
    try:
        yield staging
        publish_directory(staging, dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()
