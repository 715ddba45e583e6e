"""Atomic writes: a reader (or a crash) never sees half a file or half a directory."""

from __future__ import annotations

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


@contextmanager
def atomic_directory(dest: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory that replaces ``dest`` only if the block finishes."""
    dest = Path(dest)
    if dest.exists() and any(dest.iterdir()) and not overwrite:
        raise FileExistsError(f"{dest} already exists and is not empty; choose another --out or pass --overwrite")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".tmp-", dir=dest.parent))
    try:
        yield tmp
        if dest.exists():
            old = dest.with_name(dest.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(dest, old)
            os.rename(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
