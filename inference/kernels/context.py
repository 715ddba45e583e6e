"""One model's eager fast paths, made once and held by the verification backend that uses them: the
packed GEMM's packs, the direct forward (with the C++ layers where they serve) and the screened greedy
head. Each is made on first use and its build time recorded, so the runtime keeps it out of speed
figures; a caller that decodes many prompts keeps one context per model and pays each build once."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from torch import nn

from draftsmith.inference.kernels.direct_forward import DirectForward, direct_forward_supported
from draftsmith.inference.kernels.greedy_head import GreedyHead, greedy_head_supported
from draftsmith.inference.kernels.options import KernelOptions
from draftsmith.inference.kernels.packed_gemm import PackedGemm, packed_gemm_supported

T = TypeVar("T")


class KernelContext:
    """The fast paths ``options`` allow for ``model`` (see the module docstring). ``setup_seconds``:
    time spent building them so far (packing included)."""

    def __init__(self, model: nn.Module, options: KernelOptions) -> None:
        self.model, self.options = model, options
        self.gemm = PackedGemm(model) if options.packed_gemm and packed_gemm_supported(model) else None
        self._direct: DirectForward | None = None
        self._head: GreedyHead | None = None
        self._built_seconds = 0.0

    @property
    def setup_seconds(self) -> float:
        return self._built_seconds + (self.gemm.pack_seconds if self.gemm is not None else 0.0)

    def direct(self) -> DirectForward | None:
        """The direct forward, or None where the model's own forward must run (not a supported Llama, in
        training mode, or carrying hooks: checked on every call, since a user may change that)."""
        if not self.options.direct_forward or not direct_forward_supported(self.model):
            return None
        if self._direct is None:  # its first build loads (or compiles) the C++ extension
            self._direct = self._timed(lambda: DirectForward(self.model, self.options.native))
        return self._direct

    def greedy_head(self) -> GreedyHead | None:
        """The screened head for greedy verification through the direct forward, remade whenever the
        head's weight was replaced or changed in place (a stale screen could miss the argmax)."""
        if not self.options.greedy_head or self.direct() is None or not greedy_head_supported(self.model):
            return None
        if self._head is None or not self._head.source.still(self.model.lm_head.weight):
            self._head = self._timed(lambda: GreedyHead(self.model.lm_head))
        return self._head

    def _timed(self, build: Callable[[], T]) -> T:
        start = time.perf_counter()
        made = build()
        self._built_seconds += time.perf_counter() - start
        return made
