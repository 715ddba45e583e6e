"""Verification forwards through MKL's packed GEMM: wide forwards that cost little more than one token.

On a CPU, a verification forward over a few rows should cost about what one token costs: the weights
are read once either way. PyTorch's default fp32 ``linear`` (MKL ``sgemm``) falls well short of that
for small row counts, so trees barely pay; MKL's packed GEMM (``cblas_sgemm_pack`` / ``compute``,
exposed as ``torch.ops.mkl._mkl_linear``; inductor's ``freezing`` uses it too) gets much closer
(``draftsmith bench-tree`` measures both on a machine).

A pack is made for one row count, so a verification forward's rows are padded up to a **row bucket**
(2, 4, 8, 16, 32): padding rows repeat the root token, attend only to committed tokens and themselves,
and no real row attends to them, so they change no real row's output; their keys land past the rows
the commit keeps. One-row forwards (plain decoding) and larger trees use the default kernel.

Packing copies every linear weight once per bucket (about the model's size: 0.5 GB for SmolLM2 in
fp32). Buckets are packed when first needed, never past half of the memory then available. The
packed kernel's rounding differs from the default one's by float32 noise, as the default kernel's
own rounding already differs between one and several rows; greedy outputs stay token-identical to
plain decoding (``bench`` checks every prompt).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.core.weight_copies import CopySource

ROW_BUCKETS = (2, 4, 8, 16, 32)
MEMORY_SHARE = 0.5  # a bucket is packed only if its packs fit in this share of the available memory


def packed_gemm_supported(model: nn.Module) -> bool:
    """Float32 weights on the CPU, with PyTorch built against MKL."""
    parameter = next(model.parameters(), None)
    return (
        parameter is not None
        and parameter.device.type == "cpu"
        and parameter.dtype == torch.float32
        and torch.backends.mkl.is_available()
        and hasattr(torch.ops.mkl, "_mkl_linear")
    )


def row_bucket(rows: int) -> int | None:
    """The padded row count of a ``rows``-row forward, or None when it runs unpadded and unpacked."""
    if rows < 2:
        return None
    return next((bucket for bucket in ROW_BUCKETS if rows <= bucket), None)


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` (same parameters, same state dict) that, while its owner's packs are active and
    gradients are off, multiplies through the pack made for the input's row count."""

    _packs: dict[int, torch.Tensor]
    _owner: PackedGemm
    _packed_from: CopySource  # the weight its packs were made from

    def active_pack(self, rows: int) -> torch.Tensor | None:
        """The pack a ``rows``-row input multiplies through now, if any."""
        return self._packs.get(rows) if self._owner.active and not torch.is_grad_enabled() else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        pack = self.active_pack(rows)
        if pack is None:
            return F.linear(x, self.weight, self.bias)
        out = torch.ops.mkl._mkl_linear(x.reshape(rows, x.shape[-1]), pack, self.weight, self.bias, rows)
        return out.reshape(*x.shape[:-1], out.shape[-1])


class PackedGemm:
    """The packs of one target model, held by its kernel context (:mod:`kernels.context`). It turns the
    model's ``nn.Linear`` modules into :class:`PackedLinear`, which behave exactly as before outside
    :meth:`rows`' context; a later ``PackedGemm`` of the same model takes them over, with no packs yet."""

    def __init__(self, model: nn.Module) -> None:
        self.active = False
        self._linears: list[PackedLinear] = []
        for module in model.modules():
            if type(module) in (nn.Linear, PackedLinear):
                module.__class__ = PackedLinear
                module._packs, module._owner = {}, self
                self._linears.append(module)
        self._bytes_per_bucket = sum(m.weight.numel() * m.weight.element_size() for m in self._linears)
        self._refused: set[int] = set()
        self.pack_seconds = 0.0  # time spent packing so far: callers keep it out of speed figures

    @property
    def buckets(self) -> list[int]:
        """The row counts packed so far."""
        return sorted(self._linears[0]._packs) if self._linears else []

    def padded_rows(self, rows: int) -> int:
        """How many rows a ``rows``-row verification forward should run with: its bucket when that
        bucket is (or can be) packed, else ``rows`` itself."""
        bucket = row_bucket(rows)
        if bucket is None or not self._linears:
            return rows
        self._drop_stale_packs()
        return bucket if self._ensure(bucket) else rows

    def _drop_stale_packs(self) -> None:
        """A pack is a copy: after a weight is replaced or changed in place (an optimizer step,
        ``load_state_dict``) its packs would multiply by the old values, so they go."""
        for module in self._linears:
            if module._packs and not module._packed_from.still(module.weight):
                module._packs.clear()

    @contextmanager
    def rows(self) -> Iterator[None]:
        """Within this context, linears whose input row count has a pack use it."""
        self.active = True
        try:
            yield
        finally:
            self.active = False

    def _ensure(self, bucket: int) -> bool:
        missing = [module for module in self._linears if bucket not in module._packs]
        if not missing:
            return True
        if bucket in self._refused or self._bytes_per_bucket > MEMORY_SHARE * _available_bytes():
            self._refused.add(bucket)
            return False
        start = time.perf_counter()
        with torch.no_grad():
            for module in missing:
                module._packs[bucket] = torch.ops.mkl._mkl_reorder_linear_weight(module.weight.detach(), bucket)
                module._packed_from = CopySource(module.weight)
        self.pack_seconds += time.perf_counter() - start
        return True


def _available_bytes() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
