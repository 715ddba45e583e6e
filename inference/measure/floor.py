"""The physical floor of a decoding step on this machine: the bytes of weights one step must read,
over the speed at which this machine reads memory. ``bench-tree`` prints every forward against it.

A one-token step reads every decoder weight once, the head as the runtime reads it (the screened int8
copy where greedy verification uses it, else the float32 head) and one embedding row; nothing a step
does can take less time than reading those bytes once. The read speed is measured here, as torch's
``sum`` over a buffer far larger than the caches, with torch's current thread count.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from draftsmith.inference.kernels.greedy_head import GreedyHead
from draftsmith.inference.kernels.linear_choice import median_seconds

BUFFER_BYTES = 512 * 2**20  # well past any CPU's last-level cache
REPEATS = 5


def step_weight_bytes(model: nn.Module, screened: GreedyHead | None) -> int:
    """Bytes of weights one plain decoding step of ``model`` reads (each shared tensor once)."""
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    skipped = {embedding.data_ptr(), head.data_ptr()}  # read as one row, and as the head is read
    seen: set[int] = set()
    total = 0
    for parameter in model.parameters():
        pointer = parameter.data_ptr()
        if pointer in skipped or pointer in seen:
            continue
        seen.add(pointer)
        total += parameter.numel() * parameter.element_size()
    if screened is not None:
        head_bytes = screened.quantized.numel() * screened.quantized.element_size()
        head_bytes += screened.scales.numel() * screened.scales.element_size()
    else:
        head_bytes = head.numel() * head.element_size()
    return total + head_bytes + embedding.shape[1] * embedding.element_size()


def read_bytes_per_second() -> float:
    """This machine's memory read speed (median of a few passes of torch's ``sum``)."""
    buffer = torch.ones(BUFFER_BYTES // 4, dtype=torch.float32)
    return BUFFER_BYTES / median_seconds(buffer.sum, REPEATS)  # its warm-up touches the pages, starts threads


def step_floor(model: nn.Module, screened: GreedyHead | None) -> dict[str, Any]:
    """The weights a step reads, the measured read speed and their ratio: the floor of one step."""
    weight_bytes = step_weight_bytes(model, screened)
    speed = read_bytes_per_second()
    return {"weight_bytes": weight_bytes, "read_gb_per_s": speed / 1e9, "floor_ms": 1e3 * weight_bytes / speed}


def floor_note(floor: dict[str, Any]) -> str:
    return (
        f"A step reads {floor['weight_bytes'] / 1e6:.0f} MB of weights; this machine reads "
        f"{floor['read_gb_per_s']:.1f} GB/s (torch sum over {BUFFER_BYTES // 2**20} MiB), so no step can take "
        f"less than {floor['floor_ms']:.1f} ms (the floor)."
    )
