"""A feature drafter's decoder layer (EAGLE's, EAGLE-3's) as one C++ call: the drafter's round costs
a few small forwards whose ~100 ATen calls each, not their products, are most of its time on a CPU.

:class:`NativeDrafterLayer` is the :class:`~draftsmith.core.drafting.LayerKernel` the runtime hands
such a drafter (:meth:`~draftsmith.core.drafting.Drafter.use_layer_kernel`): given the layer's attention
input and residual, ``native.cpp``'s ``drafter_layer`` runs the q, k, v products through the drafter's
active packs (:mod:`packed_gemm`), the rotary embedding, the key and value rows written into the
drafter's preallocated cache, ``attend``'s attention under the drafter's mask, the output projection
and the gated MLP. Its rounding differs from the module's own forward (another attention and other
products), which changes at most which tokens the drafter proposes, never what verification commits.

It serves float32 CPU layers without biases whose MLP is SiLU-gated; anything else (and training,
which needs autograd) keeps the module's forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType

import torch
from torch import nn

from draftsmith.core.cache import PreallocatedCache
from draftsmith.inference.kernels.direct_forward import _rotary_factors
from draftsmith.inference.kernels.native_layers import _pack_inputs, projections_of, silu_gated

_UNREAD = torch.empty(0)  # the input norm's slot in the extension's nine weights: the drafter norms itself


@dataclass(frozen=True)
class _LayerPlan:
    """What the extension reads, gathered once per layer; ``linears``, ``siblings`` and ``pack_inputs``
    as :class:`~draftsmith.inference.kernels.native_layers.NativePlan` holds them (its pack reader)."""

    weights: list[torch.Tensor]
    linears: list[nn.Module]  # q, k, v, o, gate, up, down
    siblings: list[tuple[nn.Module, ...]]  # (q, k, v) and (gate, up), which read one input
    post_norm_eps: float
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    pack_inputs: dict = field(default_factory=dict)


class NativeDrafterLayer:
    """``(attention, post_norm, mlp, attention_input, residual, position_embeddings, mask, cache)`` →
    ``(residual + attention, MLP output)`` through the extension, or None where it cannot serve."""

    def __init__(self, extension: ModuleType) -> None:
        self.extension = extension
        self._plans: dict[tuple[int, int, int], _LayerPlan | None] = {}

    def __call__(
        self,
        attention: nn.Module,
        post_norm: nn.Module,
        mlp: nn.Module,
        attention_input: torch.Tensor,
        residual: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
        cache: object,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        if torch.is_grad_enabled() or not isinstance(cache, PreallocatedCache) or attention_input.shape[0] != 1:
            return None
        plan = self._plan(attention, post_norm, mlp)
        if plan is None or attention_input.dtype != torch.float32 or attention_input.device.type != "cpu":
            return None
        rows = attention_input.shape[1]
        layer = cache.layers[attention.layer_idx]
        if not layer.is_initialized:
            empty = attention_input.new_empty(1, plan.kv_heads, 0, plan.head_dim)
            layer.lazy_initialization(empty, empty)
        key_buffer, value_buffer, start = layer.append_rows(rows)
        cos, signed_sin = _rotary_factors(position_embeddings)
        packs, kinds, fused = _pack_inputs(plan, rows)
        after, out = self.extension.drafter_layer(
            attention_input,
            residual,
            plan.weights,
            packs,
            kinds,
            fused,
            plan.post_norm_eps,
            cos,
            signed_sin,
            None if mask is None else mask[:, :, :, : start + rows],
            key_buffer,
            value_buffer,
            start,
            plan.heads,
            plan.kv_heads,
            plan.head_dim,
            plan.scaling,
        )
        return after, out.view(1, rows, -1)

    def _plan(self, attention: nn.Module, post_norm: nn.Module, mlp: nn.Module) -> _LayerPlan | None:
        key = (id(attention), id(post_norm), id(mlp))
        if key not in self._plans:
            self._plans[key] = _layer_plan(attention, post_norm, mlp)
        return self._plans[key]


def _layer_plan(attention: nn.Module, post_norm: nn.Module, mlp: nn.Module) -> _LayerPlan | None:
    """The extension's view of a layer (the projections' transposed weights: views, so in-place updates
    show through), or None for a layer it does not compute."""
    linears = list(projections_of(attention, mlp))
    if not silu_gated(mlp):
        return None
    if any(linear.bias is not None for linear in linears) or attention.head_dim > 256:
        return None
    if any(linear.weight.dtype != torch.float32 or linear.weight.device.type != "cpu" for linear in linears):
        return None
    head_dim = attention.head_dim
    weights = [_UNREAD, *(linear.weight.t() for linear in linears), post_norm.weight]
    return _LayerPlan(
        weights=weights,
        linears=linears,
        siblings=[tuple(linears[:3]), tuple(linears[4:6])],
        post_norm_eps=post_norm.variance_epsilon,
        heads=attention.q_proj.out_features // head_dim,
        kv_heads=attention.k_proj.out_features // head_dim,
        head_dim=head_dim,
        scaling=attention.scaling,
    )

