"""The physical floor of a decoding step on this machine: the bytes of weights one step must read,
over the speed at which this machine reads memory; and for a forward of several rows, the multiply-adds
its linears make, over the speed at which this machine multiplies. ``bench-tree`` prints every forward
against the higher of the two.

A one-token step reads every decoder weight once, the head as the runtime reads it (the screened int8
copy where greedy verification uses it, else the float32 head) and one embedding row; nothing a step
does can take less time than reading those bytes once. The read speed is measured here, as torch's
``sum`` over a buffer far larger than the caches, with torch's current thread count, in passes a
benchmark takes before its warm-up and after its timed work, never between timed forwards
(:class:`ReadSpeed`).

A forward of k rows also makes k multiply-adds per weight of its linears besides the head (float32 for
a float32 target: the promise of token identity keeps them so). Past a few rows that work, not the
reading, bounds a verification forward: the multiply-add speed is measured as the best of a few matrix
products in the model's dtype through torch's GEMM, which runs near the vector units' peak
(:func:`multiply_add_rate`).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from torch import nn

from draftsmith.inference.kernels.greedy_head import GreedyHead
from draftsmith.inference.kernels.native import native_extension
from draftsmith.inference.kernels.packed_gemm import stream_pack_bytes

BUFFER_BYTES = 512 * 2**20  # well past any CPU's last-level cache
REPEATS = 5


def step_weight_bytes(model: nn.Module, screened: GreedyHead | None, as_packed: bool = True) -> int:
    """Bytes of weights one plain decoding step of ``model`` reads (each shared tensor once); with
    ``as_packed``, a linear's stream pack where it has one (4-bit codes and bfloat16 read fewer bytes)."""
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    skipped = {embedding.data_ptr(), head.data_ptr()}  # read as one row, and as the head is read
    packed = stream_pack_bytes(model) if as_packed else {}
    seen: set[int] = set()
    total = 0
    for parameter in model.parameters():
        pointer = parameter.data_ptr()
        if pointer in skipped or pointer in seen:
            continue
        seen.add(pointer)
        total += packed.get(pointer, parameter.numel() * parameter.element_size())
    if screened is not None:
        head_bytes = screened.quantized.numel() * screened.quantized.element_size()
        head_bytes += screened.scales.numel() * screened.scales.element_size()
    else:
        head_bytes = packed.get(head.data_ptr(), head.numel() * head.element_size())
    return total + head_bytes + embedding.shape[1] * embedding.element_size()


class ReadSpeed:
    """This machine's memory read speed: torch's ``sum`` over a buffer far larger than the caches (in
    memory backed by huge pages where the runtime's stream packs are, :mod:`native`), timed a pass at a
    time. A benchmark takes passes before its warm-up and after its timed work (:meth:`passes`), not
    between timed forwards: on a virtual machine a pass can push the benchmark's own memory out on the host
    (the forward right after one ran several times slower on the 2-core VM this was measured on, and the
    next few stayed slow), which made the forwards timed after a pass look slower than they are."""

    def __init__(self) -> None:
        extension = native_extension()
        count = BUFFER_BYTES // 4
        self.huge_pages = extension is not None
        self.buffer = extension.huge_page_empty([count]) if self.huge_pages else torch.empty(count)
        self.buffer.fill_(1.0)  # touches the pages
        self.buffer.sum()  # starts the threads
        self.seconds: list[float] = []

    def sample(self) -> None:
        start = time.perf_counter()
        self.buffer.sum()
        self.seconds.append(time.perf_counter() - start)

    def passes(self, count: int = REPEATS) -> None:
        for _ in range(count):
            self.sample()

    def bytes_per_second(self) -> float:
        """The median pass's speed (a few passes are taken first where none was)."""
        while len(self.seconds) < REPEATS:
            self.sample()
        return BUFFER_BYTES / statistics.median(self.seconds)

    def summary(self) -> dict[str, Any]:
        """The passes taken so far, for a results file: median, slowest and fastest GB/s."""
        speeds = sorted(BUFFER_BYTES / seconds / 1e9 for seconds in self.seconds)
        return {
            "median": round(statistics.median(speeds), 1),
            "min": round(speeds[0], 1),
            "max": round(speeds[-1], 1),
            "passes": len(speeds),
            "huge_pages": self.huge_pages,
        }


def linear_multiply_adds(model: nn.Module) -> int:
    """Multiply-adds one row makes in ``model``'s linears besides its head (which the runtime may screen in
    integers): one per weight."""
    head = model.get_output_embeddings()
    linears = (module for module in model.modules() if isinstance(module, nn.Linear) and module is not head)
    return sum(module.weight.numel() for module in linears)


GEMM_SIZE = 1024  # a product of this many rows by a square weight: long enough to run at the machine's peak


def multiply_add_rate(dtype: torch.dtype = torch.float32, repeats: int = REPEATS) -> float:
    """Multiply-adds per second of this machine in ``dtype`` with torch's current thread count: the best
    of ``repeats`` products of two GEMM_SIZE-square matrices through torch's GEMM (MKL's or oneDNN's, which
    run near the vector units' peak)."""
    a = torch.randn(GEMM_SIZE, GEMM_SIZE, dtype=dtype)
    b = torch.randn(GEMM_SIZE, GEMM_SIZE, dtype=dtype)
    torch.mm(a, b)  # starts the threads and the library
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return GEMM_SIZE**3 / best


def step_floor(model: nn.Module, screened: GreedyHead | None, speed: ReadSpeed | None = None) -> dict[str, Any]:
    """The weights a step reads, the read speed (``speed``'s passes, or a few taken now) and their
    ratio: the floor of one step; with the multiply-adds of a row and this machine's multiply-add speed,
    from which :func:`rows_floor_ms` bounds a forward of several rows."""
    weight_bytes = step_weight_bytes(model, screened)
    speed = speed or ReadSpeed()
    bytes_per_second = speed.bytes_per_second()
    parameter = next(model.parameters())
    return {
        "weight_bytes": weight_bytes,
        "unpacked_weight_bytes": step_weight_bytes(model, screened, as_packed=False),
        "read_gb_per_s": bytes_per_second / 1e9,
        "huge_pages": speed.huge_pages,
        "floor_ms": 1e3 * weight_bytes / bytes_per_second,
        "row_multiply_adds": linear_multiply_adds(model),
        "multiply_adds_per_s": multiply_add_rate(parameter.dtype) if parameter.device.type == "cpu" else None,
    }


def rows_floor_ms(floor: dict[str, Any], rows: int) -> float:
    """No forward of ``rows`` rows takes less than reading the weights once, nor less than its linears'
    multiply-adds at this machine's speed."""
    rate = floor.get("multiply_adds_per_s")
    compute = 1e3 * rows * floor["row_multiply_adds"] / rate if rate and "row_multiply_adds" in floor else 0.0
    return max(floor["floor_ms"], compute)


def floor_note(floor: dict[str, Any]) -> str:
    unpacked = floor.get("unpacked_weight_bytes", floor["weight_bytes"])
    held = f" ({unpacked / 1e6:.0f} MB as the model holds them)" if unpacked != floor["weight_bytes"] else ""
    note = (
        f"A step reads {floor['weight_bytes'] / 1e6:.0f} MB of weights{held}; this machine reads "
        f"{floor['read_gb_per_s']:.1f} GB/s (torch sum over {BUFFER_BYTES // 2**20} MiB"
        f"{' on huge pages' if floor.get('huge_pages') else ''}, median pass), so no step can take less than "
        f"{floor['floor_ms']:.1f} ms (the floor)."
    )
    if not floor.get("multiply_adds_per_s"):
        return note
    rate, adds = floor["multiply_adds_per_s"], floor["row_multiply_adds"]
    return note + (
        f" Each row makes {adds / 1e6:.0f} M multiply-adds in the linears and this machine makes "
        f"{rate / 1e9:.0f} G a second (torch's GEMM, best of {REPEATS}), so past "
        f"{floor['floor_ms'] / (1e3 * adds / rate):.1f} rows a forward's floor is its multiply-adds, not its reading."
    )
