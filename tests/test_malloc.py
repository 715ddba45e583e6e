"""Freed memory kept for reuse (core/malloc.py): a large block freed and allocated again, step after step,
is not page-faulted in anew, in a process of its own."""

import os
import platform
import subprocess
import sys

import pytest

from draftsmith.core.malloc import OPT_OUT

ROUNDS = 10
# Each round allocates a 64 MB tensor (16,384 pages of 4 KB) and a small one, then frees the large one:
# what a training step does with its activations. Prints the minor page faults of each round.
PROGRAM = f"""
import resource, torch
from draftsmith.core.malloc import keep_freed_memory
print(keep_freed_memory())
for _ in range({ROUNDS}):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = torch.ones(64 << 20, dtype=torch.uint8)
    small = torch.ones(1000)
    del block
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults_per_round(opt_out: bool) -> tuple[bool, list[int]]:
    env = {key: value for key, value in os.environ.items() if key != OPT_OUT}
    if opt_out:
        env[OPT_OUT] = "1"
    lines = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, check=True)
    kept, *faults = lines.stdout.split()
    return kept == "True", [int(count) for count in faults]


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_a_block_freed_and_allocated_again_is_reused_not_faulted_in_anew():
    kept, faults = faults_per_round(opt_out=False)
    assert kept
    assert sum(faults[ROUNDS // 2 :]) < 1000  # after a few rounds the freed blocks are reused
    returned, faults = faults_per_round(opt_out=True)
    assert not returned
    assert all(count >= 16_000 for count in faults)  # glibc's default: every round maps and zeroes it again
