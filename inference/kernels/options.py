"""The runtime's kernel choices, declared once: the CLI parses them into one :class:`KernelOptions` and
every decoding path (``generate``, ``bench``, ``bench-tree``, ``tune``) reads that object."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class KernelOptions:
    """How the runtime runs the target's verification forwards and a drafter's linears. Every choice decodes
    the same tokens; they differ in speed and in what they need (float32 on a CPU for the last ones)."""

    compiled: bool = False  # torch.compile'd forwards over bucketed trees (kernels/compiled.py)
    direct_forward: bool = True  # skip transformers' per-call machinery, bitwise the same (kernels/direct_forward.py)
    linear: str = "auto"  # the linears' kernel: auto, stream, onednn, mkl or default (kernels/packed_gemm.py)
    greedy_head: bool = True  # greedy argmax through a screened int8 head with a proof (kernels/greedy_head.py)
    native: bool = True  # the direct forward's layers and the head's contender search in C++ (kernels/native.py)
    weight_codes: bool = True  # stream packs of exact 4- or 8-bit block weights hold their codes (kernels/native.cpp)
    # a feature drafter's stream packs hold 4-bit codes of its weights rounded to blocks: it proposes from
    # slightly rounded weights (verification, and so every output token, is unchanged) at a third of the bytes
    drafter_codes: bool = True
    threads: int | None = None  # torch's intra-op threads; None leaves torch's choice

    def apply_threads(self) -> None:
        """Set torch's thread count, where one was asked for (before the target loads)."""
        if self.threads:
            torch.set_num_threads(self.threads)

    def settings(self) -> dict[str, Any]:
        """The choices a measurement depends on, as ``bench`` records them (a resumed bench must match)."""
        return {
            "compiled": self.compiled,
            "linear": self.linear,
            "greedy_head": self.greedy_head,
            "native": self.native,
            "weight_codes": self.weight_codes,
            "drafter_codes": self.drafter_codes,
        }
