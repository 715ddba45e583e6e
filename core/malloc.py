"""glibc's malloc told to keep the memory a process frees, so the next step's tensors reuse it.

By default glibc hands blocks above its mmap threshold (at most 32 MB) to the kernel when they are freed,
and trims the heap's free top: a CPU training step that allocates and frees its large activations (the
draft vocabulary's logits of a batch run to hundreds of MB) then page-faults every one of them in again,
and the kernel zeroes each page first (``docs/benchmarks.md``, training throughput, measures what that
costs). Keeping freed memory is what tcmalloc and jemalloc do,
which PyTorch's CPU performance guides preload for the same reason.

Kept memory is not bounded by a step's peak, though: batches of different lengths leave free blocks
between live ones that the next shapes do not fit, and a long run over variable-length data grew past
the machine's memory that way (an offline EAGLE-3 run on 15,620 conversations, killed by the kernel at
24 GB after ~150 steps, whose steps needed ~8). :func:`return_freed_memory_if_low` hands the free pages
back (``malloc_trim``) when the machine runs short, which costs one step's page faults now and then.

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
# below this share of the machine's memory available, free pages go back to the kernel (several ranks, or
# other jobs, share the machine: the kernel's figure counts them all)
LOW_MEMORY_SHARE = 0.25
OPT_OUT = "DRAFTSMITH_RETURN_FREED_MEMORY"  # set to 1: leave glibc's defaults (memory returned when freed)


def _glibc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    return ctypes.CDLL(None)  # the C library this process already runs on


def keep_freed_memory() -> bool:
    """Ask glibc never to map large blocks on their own and not to trim its heap, so freed memory is
    reused; True where that was done (Linux with glibc, unless ``DRAFTSMITH_RETURN_FREED_MEMORY=1``)."""
    libc = _glibc()
    mallopt = getattr(libc, "mallopt", None)
    if os.environ.get(OPT_OUT) == "1" or mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM))


def available_share(meminfo: str = "/proc/meminfo") -> float | None:
    """The kernel's MemAvailable over MemTotal, or None where the file does not say."""
    try:
        fields = dict(line.split(":", 1) for line in open(meminfo).read().splitlines() if ":" in line)
        return int(fields["MemAvailable"].split()[0]) / int(fields["MemTotal"].split()[0])
    except (OSError, KeyError, ValueError, ZeroDivisionError):
        return None


def return_freed_memory_if_low(low: float = LOW_MEMORY_SHARE) -> bool:
    """Hand the heap's free pages back to the kernel (glibc's ``malloc_trim``) if less than ``low`` of the
    machine's memory is available; True when it did."""
    trim = getattr(_glibc(), "malloc_trim", None)
    share = available_share()
    if trim is None or share is None or share >= low:
        return False
    trim(0)
    return True
