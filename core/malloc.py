"""glibc's malloc told, on request, to keep the memory a process frees, so the next step's tensors reuse it.

By default glibc hands blocks above its mmap threshold (at most 32 MB) to the kernel when they are freed,
and trims the heap's free top: a step that allocates and frees large tensors then page-faults them in
again, and the kernel zeroes each page first. ``DRAFTSMITH_KEEP_FREED_MEMORY=1`` makes every draftsmith
command keep freed memory instead (what tcmalloc and jemalloc do, which PyTorch's CPU guides preload).

It is off by default because kept memory is not bounded by a step's peak: batches of other shapes leave
free blocks between live ones that later tensors do not fit. An offline EAGLE-3 run over the whole
``sharegpt-smollm2`` set grew that way to 24 GB and was killed by the kernel, twice, although its steps
need ~8; handing the free pages back under pressure (:func:`return_freed_memory_if_low`) kept it alive,
trimming every 10-40 steps. The gain it was made for is small once the losses stopped materialising all
rows' logits (``docs/benchmarks.md``, training, measures it); what is left is the first steps' faults.

A freed block waits for a request it fits. PyTorch asks for 64-byte-aligned blocks, which glibc before 2.38
carves from a free block only if it is larger than asked by the alignment's slack, and the slivers it cut
off a neighbour may sit in its per-thread cache instead of rejoining it: so the same tensor size may take
fresh memory for a few steps before the freed blocks merge (``docs/benchmarks.md`` measures the excess).
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
from pathlib import Path

_M_TRIM_THRESHOLD = -1  # mallopt's parameter numbers (malloc.h)
_M_MMAP_MAX = -4
_NEVER_TRIM = 2**31 - 1  # mallopt takes an int: the heap's free top is returned only past 2 GiB
# below this share of the machine's memory available, free pages go back to the kernel (several ranks, or
# other jobs, share the machine: the kernel's figure counts them all)
LOW_MEMORY_SHARE = 0.25
OPT_IN = "DRAFTSMITH_KEEP_FREED_MEMORY"  # set to 1: keep freed memory for reuse


@functools.cache  # the trainer asks after every step
def _glibc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    return ctypes.CDLL(None)  # the C library this process already runs on


def keep_freed_memory() -> bool:
    """With ``DRAFTSMITH_KEEP_FREED_MEMORY=1``, ask glibc never to map large blocks on their own and not to
    trim its heap, so freed memory is reused; True where that was done (Linux with glibc)."""
    libc = _glibc()
    mallopt = getattr(libc, "mallopt", None)
    if os.environ.get(OPT_IN) != "1" or mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM))


def available_share(meminfo: str = "/proc/meminfo") -> float | None:
    """The kernel's MemAvailable over MemTotal, or None where the file does not say."""
    try:
        fields = dict(line.split(":", 1) for line in Path(meminfo).read_text().splitlines() if ":" in line)
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
