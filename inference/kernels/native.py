"""The runtime's C++ extension (``native.cpp``): its decoder layers (:mod:`native_layers`), the
row-invariant attention (:mod:`attention`), the stream kernel (:mod:`packed_gemm`) and the screened
head's int8 product, contender search and proof (:mod:`greedy_head`).

It is built by :func:`torch.utils.cpp_extension.load` the first time a process needs it (a C++
compiler, Python's headers and ninja; tens of seconds) and cached in torch's extensions directory
(``TORCH_EXTENSIONS_DIR``), one folder per torch release and source digest, so later processes import
the finished library in well under a second, without torch's build lock. Where it cannot be
built, the runtime says so once and keeps the Python code and SDPA: the same tokens as plain decoding
then computes, a slower step. ``-ffp-contract=off``: an expression like ``a * b + c * d`` rounds each
operation as ATen's separate calls do (the kernels that fuse multiply-adds say so with intrinsics).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import shutil
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

_SOURCE = Path(__file__).with_name("native.cpp")
_FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]
# A build lock older than this was left by a process killed while it held it (a build takes about a minute).
_STALE_LOCK_SECONDS = 600.0


@functools.cache
def source_digest() -> str:
    """A short digest of ``native.cpp``: what a result measured on its kernels is valid for."""
    return hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:12]


@functools.cache
def extension_name() -> str:
    """One build per torch release and per source: an edited ``native.cpp`` builds in a folder of its own,
    so no process ever rebuilds a library another process has loaded or is loading."""
    release = "".join(c if c.isalnum() else "_" for c in torch.__version__)
    return f"draftsmith_native_torch{release}_{source_digest()}"


def build_directory() -> Path:
    """torch's folder for this extension's build (one per torch release and source)."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(extension_name(), verbose=False))


@functools.cache  # a shared library loads once per process (Python cannot unload it): one attempt
def native_extension() -> ModuleType | None:
    """The compiled extension, built on this process's first call where no cached build exists; None
    (said once on stderr) where it cannot be built."""
    try:
        directory = build_directory()
        _wait_for_a_build_in_progress(directory / "lock")
        return _import_built(directory) or _build()
    except Exception as error:  # no compiler, headers or ninja: the Python code computes the same
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        print(
            f"[native] could not build the runtime's C++ kernels ({reason[:200]}); decoding keeps the Python "
            "code (the same tokens, a slower step). Install g++ and ninja to enable them, or pass --no-native.",
            file=sys.stderr,
        )
        return None


def _wait_for_a_build_in_progress(lock: Path) -> None:
    """torch's build lock is a bare file that its holder removes when done; a process killed while holding
    it leaves it behind, and torch's ``load`` would then wait for it forever. A lock older than any build
    is such a leftover: removed, said in one line."""
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > _STALE_LOCK_SECONDS:
            print(f"[native] removing {lock}: a build lock left by a process that was stopped", file=sys.stderr)
            lock.unlink(missing_ok=True)
            _library_path(lock.parent).unlink(missing_ok=True)  # its link may be unfinished
            return
        time.sleep(0.5)


def _library_path(directory: Path) -> Path:
    return directory / f"{extension_name()}.so"


def _import_built(directory: Path) -> ModuleType | None:
    """The library a finished build left, imported without torch's ``load``: ``load`` takes the build lock
    even to import, so a process stopped at that moment would leave the lock behind."""
    library = _library_path(directory)
    if not library.is_file():
        return None
    spec = importlib.util.spec_from_file_location(extension_name(), library)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError:  # damaged (a link cut short): built again
        library.unlink(missing_ok=True)
        return None
    return module


def _build() -> ModuleType:
    from torch.utils.cpp_extension import load

    _put_ninja_on_path()
    print("[native] building the runtime's C++ kernels once (~30 s; cached for later runs)", file=sys.stderr)
    return load(name=extension_name(), sources=[str(_SOURCE)], extra_cflags=_FLAGS, verbose=False)


def _put_ninja_on_path() -> None:
    """torch runs ``ninja`` from PATH; the pip package's copy sits in the environment's own bin folder,
    which is not on PATH when the environment's programs are run without activating it."""
    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError:
        return  # load() then says that ninja is missing
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
