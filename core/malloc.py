"""glibc's malloc told to keep the memory a process frees, so the next step's tensors reuse it.

By default glibc hands blocks above its mmap threshold (at most 32 MB) to the kernel when they are freed,
and trims the heap's free top: a CPU training step that allocates and frees its large activations (the
draft vocabulary's logits of a batch run to hundreds of MB) then page-faults every one of them in again,
and the kernel zeroes each page first (``docs/benchmarks.md``, training throughput, measures what that
costs). Keeping freed memory is what tcmalloc and jemalloc do,
which PyTorch's CPU performance guides preload for the same reason; a process then holds its peak
memory until it exits, which a training run or a decoding session reaches at its first step anyway.

A freed block waits for a request it fits. PyTorch asks for 64-byte-aligned blocks, which glibc before 2.38
carves from a free block only if it is larger than asked by the alignment's slack, and the slivers it cut
off a neighbour may sit in its per-thread cache instead of rejoining it: so the same tensor size may take
fresh memory for a few steps before the freed blocks merge (``docs/benchmarks.md`` measures the excess).
"""

from __future__ import annotations

import ctypes
import os
import platform

_M_TRIM_THRESHOLD = -1  # mallopt's parameter numbers (malloc.h)
_M_MMAP_MAX = -4
_NEVER_TRIM = 2**31 - 1  # mallopt takes an int: the heap's free top is returned only past 2 GiB
OPT_OUT = "DRAFTSMITH_RETURN_FREED_MEMORY"  # set to 1: leave glibc's defaults (memory returned when freed)


def keep_freed_memory() -> bool:
    """Ask glibc never to map large blocks on their own and not to trim its heap, so freed memory is
    reused; True where that was done (Linux with glibc, unless ``DRAFTSMITH_RETURN_FREED_MEMORY=1``)."""
    if os.environ.get(OPT_OUT) == "1" or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)  # the C library this process already runs on
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM))
