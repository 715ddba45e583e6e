"""The runtime's C++ extension (``native.cpp``): its decoder layers (:mod:`native_layers`), the
row-invariant attention (:mod:`attention`), the stream kernel (:mod:`packed_gemm`) and the screened
head's int8 product, contender search and proof (:mod:`greedy_head`).

It is built by :func:`torch.utils.cpp_extension.load` the first time a process needs it (a C++
compiler, Python's headers and ninja; tens of seconds) and cached in torch's extensions directory
(``TORCH_EXTENSIONS_DIR``), so later processes load it in well under a second. Where it cannot be
built, the runtime says so once and keeps the Python code and SDPA: the same tokens as plain decoding
then computes, a slower step. ``-ffp-contract=off``: an expression like ``a * b + c * d`` rounds each
operation as ATen's separate calls do (the kernels that fuse multiply-adds say so with intrinsics).
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType

import torch

_SOURCE = Path(__file__).with_name("native.cpp")
# torch's build cache tracks the sources and flags, not torch itself: a build per torch release
_NAME = "draftsmith_native_torch" + "".join(c if c.isalnum() else "_" for c in torch.__version__)


@functools.cache
def source_digest() -> str:
    """A short digest of ``native.cpp``: what a result measured on its kernels is valid for."""
    return hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:12]


def build_directory() -> Path:
    """torch's folder for this extension's build (one per torch release)."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(_NAME, verbose=False))


@functools.cache  # a shared library loads once per process (Python cannot unload it): one attempt
def native_extension() -> ModuleType | None:
    """The compiled extension, built on this process's first call where no cached build exists; None
    (said once on stderr) where it cannot be built."""
    try:
        from torch.utils.cpp_extension import load

        _put_ninja_on_path()
        if not any(build_directory().glob(f"{_NAME}*.so")):
            print("[native] building the runtime's C++ kernels once (~30 s; cached for later runs)", file=sys.stderr)
        return load(
            name=_NAME, sources=[str(_SOURCE)], extra_cflags=["-O3", "-fopenmp", "-ffp-contract=off"], verbose=False
        )
    except Exception as error:  # no compiler, headers or ninja: the Python code computes the same
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        print(
            f"[native] could not build the runtime's C++ kernels ({reason[:200]}); decoding keeps the Python "
            "code (the same tokens, a slower step). Install g++ and ninja to enable them, or pass --no-native.",
            file=sys.stderr,
        )
        return None


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
