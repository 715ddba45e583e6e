"""The C++ layers' own copies of ATen's float32 sum (the norms' mean) and SiLU: bitwise ATen's for any width
and length, under every kernel set ATen can run on this CPU (``ATEN_CPU_CAPABILITY``, in a fresh process each),
and serving wherever ATen runs vector kernels, ATen's own calls staying where a copy would not match."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from draftsmith.inference.kernels.native import native_extension

WIDTHS = [*range(1, 80), 127, 128, 129, 255, 256, 576, 640, 1000, 1536, 4100, 70000]
LENGTHS = [*range(1, 70), 1000, 1536, 2048, 3001]


@pytest.fixture(scope="module")
def native():
    extension = native_extension()
    if extension is None:
        pytest.skip("the C++ extension does not build here")
    return extension


def norm_mismatches(native) -> list[tuple[int, int]]:
    """(width, rows) where the extension's RMSNorm differs from LlamaRMSNorm by any bit."""
    generator = torch.Generator().manual_seed(3)
    found = []
    for width in WIDTHS:
        for rows in (1, 3):
            x = torch.randn(1, rows, width, generator=generator) * torch.exp(
                2 * torch.randn(1, rows, width, generator=generator)
            )
            norm = LlamaRMSNorm(width, eps=1e-5)
            with torch.no_grad():
                norm.weight.copy_(torch.randn(width, generator=generator))
                if not torch.equal(native.rms_norm(x, norm.weight, 1e-5), norm(x)):
                    found.append((width, rows))
    return found


def silu_mismatches(native) -> list[tuple[int, int, bool]]:
    """(rows, length, strided) where the extension's SiLU differs from ATen's by any bit: contiguous rows and
    rows cut from a wider product, as the stacked gate|up product's gate half is."""
    generator = torch.Generator().manual_seed(5)
    found = []
    for length in LENGTHS:
        for rows in (1, 3):
            wide = 8 * torch.randn(rows, 2 * length, generator=generator)
            for strided, gate in ((False, wide[:, :length].contiguous()), (True, wide[:, :length])):
                if not torch.equal(native.silu(gate), torch.nn.functional.silu(gate)):
                    found.append((rows, length, strided))
    return found


def test_the_norm_is_bitwise_llamas_rmsnorm_for_any_width(native):
    assert norm_mismatches(native) == []


def test_the_silu_is_bitwise_atens_for_any_length_and_layout(native):
    assert silu_mismatches(native) == []


def test_the_copies_serve_where_aten_runs_vector_kernels(native):
    """Where ATen's kernels are AVX2's or AVX-512's, the norms' sums are the copy's (8 lanes: ATen's sum kernel
    is AVX2's on both) and so is the SiLU (ATen's lanes); each is checked against ATen at first use."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("ATen runs no x86 vector kernels here")
    assert native.norm_sum_lanes(576) == 8
    assert native.norm_sum_lanes(5) == 1  # rows shorter than a vector: ATen's scalar loop
    assert native.silu_lanes() == (16 if torch.backends.cpu.get_cpu_capability() == "AVX512" else 8)


_CHILD = """
import json, sys, torch
sys.path.insert(0, {tests!r})
import test_glue_replicas as t
from draftsmith.inference.kernels.native import native_extension
native = native_extension()
torch.manual_seed(0)
expected = torch.rand(4)
torch.manual_seed(0)
native.norm_sum_lanes(4099), native.silu_lanes()  # each copy's first check draws random values of its own
untouched = torch.equal(torch.rand(4), expected)
print(json.dumps({{"capability": torch.backends.cpu.get_cpu_capability(), "rng_untouched": untouched,
                  "norms": t.norm_mismatches(native),
                  "silu": t.silu_mismatches(native), "norm_lanes": native.norm_sum_lanes(576),
                  "silu_lanes": native.silu_lanes()}}))
"""


@pytest.mark.parametrize("capability", ["default", "avx2", "avx512"])
def test_every_kernel_set_aten_can_run_here_gets_bitwise_copies(native, capability):
    """ATen picks its kernels by CPU (``ATEN_CPU_CAPABILITY`` forces a lesser set): whichever it runs, the
    copies match it bit for bit or stand aside (``default``: ATen's plain loops, which no copy claims)."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    code = _CHILD.format(tests=str(Path(__file__).parent))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    if report["capability"].lower() != capability:
        pytest.skip(f"this CPU does not run ATen's {capability} kernels")
    assert report["norms"] == [] and report["silu"] == []
    assert report["rng_untouched"]  # a user's seeded sampling draws the same numbers as without the copies
    if capability == "default":
        assert report["silu_lanes"] == 0
    else:
        assert report["norm_lanes"] == 8 and report["silu_lanes"] == (16 if capability == "avx512" else 8)
