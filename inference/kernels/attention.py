"""Row-invariant attention: every query row computed from its own query and the keys it sees alone.

PyTorch's SDPA on a CPU computes one row of a tree verification with a different blocking than the
same row in a plain one-token step; its results happen to agree on the runs checked so far, but nothing
makes them, and its fixed cost per call is a visible share of a small model's few-row forward. The C++
extension's ``attend`` (:mod:`native`) sums each row's scores, softmax and weighted values in one order
that depends only on the keys that row sees, so a row's output is bitwise the same alone, among a tree's
rows, and under a tree mask or a causal one: row-invariant by construction, as the stream kernel's
products are.

The runtime's numerical model is then the target with this attention: the direct forward and its C++
layers call it, and the model's own forwards (the prompt's prefill, a forward with hooks, the reference
``generate`` of ``bench`` and the tests) run through it inside :func:`model_attention`, which points the
model's config at the attention function registered here under :data:`ATTENTION` (transformers'
``AttentionInterface``, with SDPA's mask builder). It serves float32 models on the CPU where the
extension builds (``KernelOptions.native``); elsewhere every forward keeps SDPA.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from draftsmith.inference.kernels.native import native_extension

ATTENTION = "draftsmith_rows"  # the name the model's config selects it by
# query rows from which a forward attends through SDPA instead (sdpa_from_rows; None: never)
_SDPA_FROM_ROWS: ContextVar[int | None] = ContextVar("draftsmith_sdpa_from_rows", default=None)


def rows_attention_available(model: nn.Module, native: bool) -> bool:
    """Whether ``model``'s forwards can run the row-invariant attention: float32 on the CPU, ``native``
    asked for and the extension built."""
    parameter = next(model.parameters(), None)
    if not native or parameter is None or parameter.dtype != torch.float32 or parameter.device.type != "cpu":
        return False
    return native_extension() is not None


def rows_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """An attention function with the interface and the mask semantics of transformers'
    ``sdpa_attention_forward`` (no mask: every key for one query row, else causal; a causal prefill
    over a longer cache reads its first rows, SDPA's upper-left alignment), computed by ``attend``."""
    sdpa_from = _SDPA_FROM_ROWS.get()
    if sdpa_from is not None and query.shape[2] >= sdpa_from:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    if dropout and module.training:
        raise ValueError(f"the {ATTENTION} attention serves inference only; train with attn_implementation='sdpa'")
    if kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None:
        raise ValueError(f"the {ATTENTION} attention has no softcap or position bias; use 'sdpa' or 'eager'")
    rows, length = query.shape[2], key.shape[2]
    if attention_mask is not None:
        attention_mask = attention_mask[:, :, :, :length]
    causal = (
        rows > 1
        and attention_mask is None
        and (is_causal if is_causal is not None else getattr(module, "is_causal", True))
    )
    if causal and length > rows:
        key, value = key[:, :, :rows], value[:, :, :rows]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return native_extension().attend(query, key, value, attention_mask, float(scale), causal), None


AttentionInterface.register(ATTENTION, rows_attention_forward)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)


@contextmanager
def sdpa_from_rows(rows: int) -> Iterator[None]:
    """Within this context, a forward of ``rows`` query rows or more attends through SDPA (a long prompt's
    prefill, whose rows no later forward computes again: see :meth:`KernelContext.model_forwards`)."""
    token = _SDPA_FROM_ROWS.set(rows)
    try:
        yield
    finally:
        _SDPA_FROM_ROWS.reset(token)


@contextmanager
def model_attention(model: nn.Module) -> Iterator[None]:
    """The context in which ``model``'s own forwards attend through :data:`ATTENTION` (then its config's
    choice is restored)."""
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = before
