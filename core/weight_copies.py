"""Which weight a runtime copy (a packed GEMM pack, the screened head) was made from.

A copy multiplies by the values it was made from. Once its weight is replaced (a new parameter) or
changed in place (an optimizer step, ``load_state_dict``), the copy must be remade, or the runtime would
verify against old weights. A data pointer is not enough to tell: a replaced weight's memory can be
reused by its successor. :class:`CopySource` keeps the parameter itself and its version counter.
"""

from __future__ import annotations

import torch


class CopySource:
    """The parameter a copy was made from, and its version then."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.version = weight._version  # bumped by every in-place change

    def still(self, weight: torch.Tensor) -> bool:
        """True while ``weight`` is the same parameter, unchanged since the copy."""
        return weight is self.weight and weight._version == self.version
