"""A feature drafter's decoder layer (EAGLE's, EAGLE-3's) as one C++ call: the drafter's round costs
a few small forwards whose ~100 ATen calls each, not their products, are most of its time on a CPU.

:class:`NativeDrafterLayer` is the :class:`~draftsmith.core.drafting.LayerKernel` the runtime hands
such a drafter (:meth:`~draftsmith.core.drafting.Drafter.use_layer_kernel`): given the layer's attention
input and residual, ``native.cpp``'s ``drafter_layer`` runs the q, k, v products through the drafter's
active packs (:mod:`packed_gemm`), the rotary embedding, the key and value rows written into the
drafter's preallocated cache, ``attend``'s attention under the drafter's mask, the output projection
and the gated MLP. Its rounding differs from the module's own forward (another attention and other
products), which changes at most which tokens the drafter proposes, never what verification commits.

:meth:`NativeDrafterLayer.step` goes further for an EAGLE-3 drafter: its whole drafting forward (the
fusing ``fc``, the norms and concatenation before the layer, the layer, the residual) and its head's
top log-probabilities in one call, ``eagle3_step``, the same floats as the modules compute (the layer's
as above; the norms are the extension's exact replicas, the products the same packs'). A round's
few-row forwards otherwise spend more in ~40 small tensor calls than in their products.

It serves float32 CPU layers without biases whose MLP is SiLU-gated; anything else (and training,
which needs autograd) keeps the module's forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType

import torch
from torch import nn

from draftsmith.core.cache import PreallocatedCache
from draftsmith.core.drafting import DraftingStep
from draftsmith.inference.kernels.direct_forward import RotaryTable, _rotary_factors
from draftsmith.inference.kernels.native_layers import (
    _NO_PACK,
    PackReads,
    pack_inputs,
    projections_of,
    silu_gated,
)
from draftsmith.inference.kernels.packed_gemm import PackedLinear, active_pack, pack_kind

_UNREAD = torch.empty(0)  # the input norm's slot in the extension's nine weights: the drafter norms itself


@dataclass(frozen=True)
class _LayerPlan:
    """What the extension reads, gathered once per layer; ``linears``, ``siblings`` and ``reads`` as
    :class:`~draftsmith.inference.kernels.native_layers.NativePlan` holds them (its pack reader)."""

    weights: list[torch.Tensor]
    linears: list[nn.Module]  # q, k, v, o, gate, up, down
    siblings: list[tuple[nn.Module, ...]]  # (q, k, v) and (gate, up), which read one input
    post_norm_eps: float
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    reads: PackReads = field(default_factory=PackReads)


class NativeDrafterLayer:
    """``(attention, post_norm, mlp, attention_input, residual, position_embeddings, mask, cache)`` →
    ``(residual + attention, MLP output)`` through the extension, or None where it cannot serve."""

    def __init__(self, extension: ModuleType) -> None:
        self.extension = extension
        self._plans: dict[tuple[int, int, int], _LayerPlan | None] = {}
        # each drafter's rotary embedding with its table (by id, the module held beside it)
        self._rotary: dict[int, tuple[nn.Module, RotaryTable]] = {}

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
        plan = self._served_plan(attention, post_norm, mlp, attention_input, cache)
        if plan is None:
            return None
        rows = attention_input.shape[1]
        factors = _rotary_factors(position_embeddings)
        after, out = self.extension.drafter_layer(
            attention_input, residual, *self._layer_arguments(plan, attention, rows, factors, mask, cache)
        )
        return after, out.view(1, rows, -1)

    def step(
        self,
        step: DraftingStep,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor | None,
        cache: object,
        logit_rows: int,
        top_k: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """:meth:`~draftsmith.core.drafting.LayerKernel.step` through ``eagle3_step``, or None where a
        projection outside the layer is not a plain bias-free product, the norms' epsilons differ, or the
        layer is not served."""
        plan = self._served_plan(step.attention, step.post_norm, step.mlp, embeds, cache)
        rows = embeds.shape[1]
        fc = _projection(step.fc, rows) if step.fc is not None else (_UNREAD, _NO_PACK, 0)  # hidden read as is
        head = _projection(step.lm_head, logit_rows)
        eps = {norm.variance_epsilon for norm in (step.hidden_norm, step.input_norm, step.norm)}
        if plan is None or fc is None or head is None or len(eps) != 1 or hidden.dtype != torch.float32:
            return None
        factors = self._rotary_table(step.rotary).factors(step.rotary, hidden, position_ids)
        features, values, columns = self.extension.eagle3_step(
            embeds[0],
            hidden[0],
            *fc,
            step.hidden_norm.weight,
            step.input_norm.weight,
            eps.pop(),
            step.norm.weight,
            *head,
            logit_rows,
            top_k,
            *self._layer_arguments(plan, step.attention, rows, factors, mask, cache),
        )
        return features, values, columns

    def _served_plan(
        self, attention: nn.Module, post_norm: nn.Module, mlp: nn.Module, rows: torch.Tensor, cache: object
    ) -> _LayerPlan | None:
        """The layer's plan where the extension serves these rows (1, rows, ·) and cache, else None."""
        if torch.is_grad_enabled() or not isinstance(cache, PreallocatedCache) or rows.shape[0] != 1:
            return None
        if rows.dtype != torch.float32 or rows.device.type != "cpu":
            return None
        return self._plan(attention, post_norm, mlp)

    def _layer_arguments(
        self,
        plan: _LayerPlan,
        attention: nn.Module,
        rows: int,
        rotary_factors: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
        cache: PreallocatedCache,
    ) -> tuple:
        """drafter_layer's arguments after the attention input and residual (``rotary_factors``: the
        C++ layers' cos and signed sin, :func:`_rotary_factors`); the cache's next ``rows`` rows taken for
        the keys and values this forward writes."""
        layer = cache.layers[attention.layer_idx]
        if not layer.is_initialized:
            empty = plan.weights[1].new_empty(1, plan.kv_heads, 0, plan.head_dim)
            layer.lazy_initialization(empty, empty)
        key_buffer, value_buffer, start = layer.append_rows(rows)
        cos, signed_sin = rotary_factors
        packs, kinds, fused = pack_inputs(plan, rows)
        return (
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

    def _rotary_table(self, rotary: nn.Module) -> RotaryTable:
        if id(rotary) not in self._rotary:
            self._rotary[id(rotary)] = (rotary, RotaryTable())
        return self._rotary[id(rotary)][1]

    def _plan(self, attention: nn.Module, post_norm: nn.Module, mlp: nn.Module) -> _LayerPlan | None:
        key = (id(attention), id(post_norm), id(mlp))
        if key not in self._plans:
            self._plans[key] = _layer_plan(attention, post_norm, mlp)
        return self._plans[key]


def _projection(linear: nn.Module, rows: int) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """``eagle3_step``'s view of a bias-free float32 linear for ``rows`` rows: (transposed weight, its active
    pack or an empty one, the pack's kind); None where its forward would not be that product (a bias, or
    rows its owner sends to the default kernel)."""
    if getattr(linear, "bias", None) is not None or linear.weight.dtype != torch.float32:
        return None
    pack = active_pack(linear, rows)
    if pack is not None and isinstance(linear, PackedLinear) and linear._owner.library_serves(linear, rows):
        return None
    return linear.weight.t(), _NO_PACK if pack is None else pack, pack_kind(linear)


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
