"""Freed memory kept for reuse on request (core/malloc.py), each case in a process of its own: a large block
freed and allocated again is not page-faulted in anew, a large tensor lives on the heap, not in a mapping
of its own that freeing it would hand back to the kernel, and kept pages go back when memory runs short;
without the request, glibc's defaults."""

import os
import platform
import subprocess
import sys

import pytest

from draftsmith.core.malloc import OPT_IN

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc only"
)

ROUNDS = 6
BLOCK = 64 << 20  # 16,384 pages of 4 KB
# Each round mallocs the block, writes every page, and frees it: what a training step does with its large
# activations. Prints the minor page faults of each round.
FAULTS = f"""
import ctypes, resource
from draftsmith.core.malloc import keep_freed_memory
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
print(keep_freed_memory())
for _ in range({ROUNDS}):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc({BLOCK})
    ctypes.memset(block, 1, {BLOCK})
    libc.free(block)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
# glibc's own count of the bytes in mappings of their own (mallinfo2's hblkhd) before a tensor of the
# block's size is made, while it lives, and after it is freed.
MAPPED = f"""
import ctypes, torch
from draftsmith.core.malloc import keep_freed_memory
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
print(keep_freed_memory())
mapped = lambda: libc.mallinfo2().hblkhd
before = mapped()
block = torch.ones({BLOCK}, dtype=torch.uint8)
during = mapped()
del block
print(before, during, mapped())
"""


def run(program: str, keep: bool) -> tuple[bool, list[int]]:
    env = {key: value for key, value in os.environ.items() if key != OPT_IN}
    if keep:
        env[OPT_IN] = "1"
    lines = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, check=True)
    kept, *counts = lines.stdout.split()
    return kept == "True", [int(count) for count in counts]


def test_a_block_freed_and_allocated_again_is_reused_not_faulted_in_anew():
    kept, faults = run(FAULTS, keep=True)
    assert kept
    assert faults[0] > 0 and sum(faults[1:]) < faults[0] / 10  # faulted in once (in huge pages, where enabled)
    returned, faults = run(FAULTS, keep=False)
    assert not returned
    assert all(count > faults[0] / 2 for count in faults)  # the default: every round maps and zeroes it again


@pytest.mark.skipif(not hasattr(__import__("ctypes").CDLL(None), "mallinfo2"), reason="mallinfo2: glibc 2.33+")
def test_a_large_tensor_lives_on_the_heap_only_when_asked():
    kept, (before, during, after) = run(MAPPED, keep=True)
    assert kept
    assert during - before < BLOCK
    returned, (before, during, after) = run(MAPPED, keep=False)
    assert not returned
    assert during - before >= BLOCK and after - before < BLOCK  # mapped on its own, unmapped when freed


# A block freed in the middle of the heap (a small block allocated after it stays live, so it is not the
# heap's trimmable top): resident pages before the free, after it, after asking with a threshold no machine
# is below, and after one every machine is below.
TRIMMED = f"""
import ctypes, os
from draftsmith.core.malloc import keep_freed_memory, return_freed_memory_if_low
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
resident = lambda: int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
print(keep_freed_memory())
block = libc.malloc({4 * BLOCK})
ctypes.memset(block, 1, {4 * BLOCK})
after = libc.malloc(4096)
before = resident()
libc.free(block)
freed = resident()
never = return_freed_memory_if_low(low=0.0)
kept = resident()
always = return_freed_memory_if_low(low=1.01)
print(before, freed, int(never), kept, int(always), resident())
"""


def test_freed_memory_goes_back_to_the_kernel_only_when_the_machine_runs_short():
    kept, (before, freed, never, still, always, after) = run(TRIMMED, keep=True)
    assert kept and not never and always
    assert freed > before - BLOCK and still > before - BLOCK  # kept for reuse while memory is plentiful
    assert after < before - 3 * BLOCK  # handed back under pressure
