"""Gemma-3's verification forward without transformers' per-call machinery, bit for bit the same.

:class:`GemmaDirectForward` is :class:`~draftsmith.inference.kernels.direct_forward.DirectForward` for a
:class:`~transformers.Gemma3ForCausalLM`: the runtime's own forwards (one sequence on its preallocated
cache: a decoding step, or a tree under its mask) run the operations of ``Gemma3TextModel.forward`` and
``Gemma3DecoderLayer.forward`` on the same values in the same order with fewer calls: the scaled
embedding, one rotary embedding per layer type (sliding layers have their own), then per layer the
input norm, q, k and v (through :mod:`packed_gemm`'s packs where they are active; one row without a
pack: ``torch.mm`` on the transposed weights, what ``F.linear`` runs), the QK-norms, the rotary
embedding (its sign moved from ``q`` onto ``sin``, exact), the layer's cache written directly, the
attention (the row-invariant one of :mod:`attention`, or SDPA's wrapper, called as the model calls
them) under the layer type's mask, the output projection, the post-attention norm and the residual,
then the pre-feedforward norm, the GELU-tanh gated MLP, the post-feedforward norm and the residual; the
final norm and the head. Every Gemma RMSNorm is ``x * rsqrt(mean(x^2) + eps) * (1 + weight)``.
Where the extension's row-invariant attention serves the forward, the layers are one call of its
``gemma_layers`` (``native.cpp``: the same operations in C++, the norms' sums and GELU-tanh through ATen);
otherwise the Python loop :func:`_gemma_layers` runs them.

Masks are the model's: a tree forward gets one mask per layer type (``core.tree.masks_per_layer_type``:
the sliding one hides keys ``sliding_window`` or more positions behind their query), and a one-row step
sees every cached key in full-attention layers while its sliding layers get the model's own boolean mask
once the cache reaches the window (transformers builds none before). ``tests/test_gemma_forward.py``
checks logits, hidden states and the cache bitwise against ``model(...)`` on both sides of a window.

Any other forward (several sequences, another cache) is the model's own.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from types import ModuleType

import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from draftsmith.core.cache import PreallocatedCache
from draftsmith.core.cache_kwarg import cache_kwargs
from draftsmith.core.tree import masks_per_layer_type
from draftsmith.core.weight_copies import CopySource
from draftsmith.inference.kernels.attention import (
    model_attention,
    rows_attention_available,
    rows_attention_forward,
)
from draftsmith.inference.kernels.direct_forward import PlanSources, _projectors, _rotary_factors
from draftsmith.inference.kernels.native import native_extension
from draftsmith.inference.kernels.native_layers import NativePlan, pack_inputs, projections_of, stacked_pack
from draftsmith.inference.kernels.packed_gemm import PackedLinear, active_pack, one_pack_product

LayerMasks = dict[str, torch.Tensor | None]  # the attention mask of each layer type
# the stacked packs' kernel and, per layer, its q|k|v and gate|up packs
Stacks = tuple[str, list[tuple[torch.Tensor | None, torch.Tensor | None]]]


class GemmaDirectForward:
    """``forward(input_ids, position_ids, attention_mask, cache, output_hidden_states, head)`` of a
    :class:`~transformers.Gemma3ForCausalLM`, equal to ``model(input_ids, attention_mask=...,
    position_ids=..., **cache_kwargs(cache), use_cache=True, output_hidden_states=...)`` when the mask is
    None (a one-token step), a 4D additive mask over ``past + T`` keys (a tree: the sliding layers' mask
    is made from it as the runtime makes it) or one such mask per layer type."""

    def __init__(self, model: nn.Module, native: bool = True, rows_attention: bool | None = None) -> None:
        """``native``: the runtime's C++ extension serves the attention (``rows_attention``, by default
        ``native``: the row-invariant attention of :mod:`attention`, which the model's own forwards then
        use too), the screened head and, with that attention, the decoder layers (``gemma_layers``)."""
        self.model = model
        self.rows_attention = rows_attention_available(model, native if rows_attention is None else rows_attention)
        self._attention_function = rows_attention_forward if self.rows_attention else sdpa_attention_forward
        config = model.config
        self.layers: list[nn.Module] = list(model.model.layers[: config.num_hidden_layers])
        self.layer_types: tuple[str, ...] = tuple(config.layer_types[: config.num_hidden_layers])
        self.window: int | None = config.sliding_window if "sliding_attention" in self.layer_types else None
        self._extension = native_extension() if native else None
        self._steps: list[_GemmaLayer] | None = None
        self._steps_from = PlanSources()
        self._factors_from: list[CopySource] = []  # the norms' weights the plan's (1 + weight) were made from
        self._final_factor: torch.Tensor | None = None
        self._stacks: tuple[tuple, list] | None = None  # the stacked packs, by the state of the packs
        self._native_plan: NativePlan | None = None  # what the C++ layers read, made with the lean plan

    @staticmethod
    def serves(model: nn.Module) -> bool:
        """What this forward computes as the model does beyond its class: causal attention without logit
        softcapping (the attention's or the head's), bias-free projections."""
        config = model.config
        if config.use_bidirectional_attention or config.attn_logit_softcapping is not None:
            return False
        if getattr(config, "final_logit_softcapping", None) is not None:
            return False
        return not any(
            getattr(linear, "bias", None) is not None
            for layer in model.model.layers
            for linear in projections_of(layer.self_attn, layer.mlp)
        )

    @property
    def native(self) -> bool:
        """Whether lean forwards run the decoder layers in C++ (``gemma_layers``): with the extension's
        row-invariant attention, the one they call."""
        return self._extension is not None and self.rows_attention

    @property
    def extension(self) -> ModuleType | None:
        """The runtime's C++ extension where this forward's attention and head may use it."""
        return self._extension

    def __call__(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | LayerMasks | None,
        cache,
        output_hidden_states: bool = False,
        head: bool = True,
    ) -> CausalLMOutputWithPast | BaseModelOutputWithPast:
        """The model's output; with ``head=False``, the base model's (``last_hidden_state``: the normed
        last states, the head's input)."""
        if not self._lean(input_ids, attention_mask, cache):
            return self._models_own(input_ids, position_ids, attention_mask, cache, output_hidden_states, head)
        base = self.model.model
        x = base.embed_tokens.forward(input_ids)
        masks = self._masks(attention_mask, position_ids, cache.layers[0].get_seq_length() + x.shape[1])
        factors = {kind: _rotary_factors(base.rotary_emb(x, position_ids, kind)) for kind in set(self.layer_types)}
        hidden: list[torch.Tensor] = [x]
        layers = self._native_layers(x, factors, masks, cache)
        if layers is not None:
            hidden.extend(layers)
            x = layers[-1]
        else:
            stacks = self._stacked_packs(x.shape[1])
            x = _gemma_layers(self._steps, stacks, x, factors, masks, cache, hidden, self._attention_function)
        x = _rms_norm(x, base.norm.eps, self._final_factor)
        hidden[-1] = x  # transformers reports the normed last state as the last hidden state
        states = tuple(hidden) if output_hidden_states else None
        if not head:
            return BaseModelOutputWithPast(last_hidden_state=x, **cache_kwargs(cache), hidden_states=states)
        return CausalLMOutputWithPast(logits=self.model.lm_head(x), **cache_kwargs(cache), hidden_states=states)

    def _lean(self, input_ids: torch.Tensor, attention_mask, cache) -> bool:
        """Whether this forward is one the runtime makes (one sequence; one row without a mask or rows
        under a tree mask; its preallocated cache, already holding the prompt); the plan is rebuilt when a
        parameter or submodule of a layer was replaced."""
        one_token = input_ids.shape[1] == 1 and attention_mask is None
        if input_ids.shape[0] != 1 or not (one_token or attention_mask is not None):
            return False
        if not isinstance(cache, PreallocatedCache) or not cache.layers[0].is_initialized:
            return False
        stale = self._steps is None or not self._steps_from.current()
        if stale or not all(source.still(source.weight) for source in self._factors_from):
            self._steps, self._steps_from = _gemma_plan(self.layers, self.layer_types), PlanSources(self.layers)
            final = self.model.model.norm
            self._final_factor = _factor(final)
            norms = [norm for step in self._steps for norm in step.norms] + [final]
            self._factors_from = [CopySource(norm.weight) for norm in norms]
            self._stacks = None
            self._native_plan = _gemma_native_plan(self._steps) if self.native else None
        return True

    def _native_layers(
        self, x: torch.Tensor, factors: dict[str, tuple[torch.Tensor, torch.Tensor]], masks: LayerMasks, cache
    ) -> list[torch.Tensor] | None:
        """Each layer's output from the C++ layers (float32 on the CPU), else None with nothing done."""
        plan = self._native_plan
        if plan is None or x.dtype != torch.float32 or x.device.type != "cpu":
            return None
        rows = x.shape[1]
        packs, kinds, fused = pack_inputs(plan, rows)
        rooms = [layer.append_rows(rows) for layer in cache.layers[: len(self._steps)]]
        return self._extension.gemma_layers(
            x,
            plan.weights,
            plan.eps,
            packs,
            kinds,
            fused,
            [factors[kind][0] for kind in self.layer_types],
            [factors[kind][1] for kind in self.layer_types],
            [masks[kind] for kind in self.layer_types],
            [room[0] for room in rooms],
            [room[1] for room in rooms],
            rooms[0][2],
            [plan.heads, plan.kv_heads, plan.head_dim],
            plan.scaling,
        )

    def _stacked_packs(self, rows: int) -> Stacks | None:
        """Each layer's stacked q|k|v and gate|up packs where the projections' one-pack kernel has them
        active (:meth:`~draftsmith.inference.kernels.packed_gemm.PackedGemm.fused_pack`: their columns
        bitwise the separate products'), read again only when the packs may have changed."""
        first = self._steps[0].projections[0]
        if not isinstance(first, PackedLinear) or active_pack(first, rows) is None:
            return None
        owner = first._owner
        state = (id(owner), owner.generation, owner.active, torch.is_grad_enabled())
        if self._stacks is None or self._stacks[0] != state:
            stacks = [(_stacked(step.projections[:3]), _stacked(step.projections[4:6])) for step in self._steps]
            # keyed by the state after any stacked pack made now
            self._stacks = ((id(owner), owner.generation, owner.active, torch.is_grad_enabled()), stacks)
        return owner.kernel, self._stacks[1]

    def _masks(self, attention_mask, position_ids: torch.Tensor, length: int) -> LayerMasks:
        """Each layer type's mask over the ``length`` keys a forward's rows attend to."""
        if isinstance(attention_mask, dict):
            return attention_mask
        if attention_mask is not None:
            masks = masks_per_layer_type(self.model.config, attention_mask, position_ids)
            return masks if isinstance(masks, dict) else dict.fromkeys(self.layer_types, masks)
        # one row: every cached key, but a sliding layer's model-made mask from the window's length on
        masks: LayerMasks = dict.fromkeys(self.layer_types)
        if self.window is not None and length >= self.window:
            keys = torch.arange(length, device=position_ids.device)
            masks["sliding_attention"] = (keys > position_ids[0, -1] - self.window)[None, None, None, :]
        return masks

    def _models_own(self, input_ids, position_ids, attention_mask, cache, output_hidden_states, head):
        """A forward the lean loop does not make, through the model itself (attending as this forward does)."""
        forward = self.model if head else self.model.model
        with model_attention(self.model) if self.rows_attention else nullcontext():
            return forward(
                input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                **cache_kwargs(cache),
                use_cache=True,
                output_hidden_states=output_hidden_states,
            )


def _stacked(group: tuple[nn.Module, ...]) -> torch.Tensor | None:
    pack = stacked_pack(group)
    return pack if pack.numel() else None


def _factor(norm: nn.Module) -> torch.Tensor:
    """A Gemma RMSNorm's ``1 + weight`` as its forward computes it (made once per plan: the same floats)."""
    return 1.0 + norm.weight.detach().float()


def _rms_norm(x: torch.Tensor, eps: float, factor: torch.Tensor) -> torch.Tensor:
    """``Gemma3RMSNorm.forward``, the same operations in the same order (the float32 casts are no-ops
    on float32 rows), its ``1 + weight`` given as ``factor``."""
    h = x if x.dtype == torch.float32 else x.float()
    out = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * factor
    return out if out.dtype == x.dtype else out.type_as(x)


@dataclass(frozen=True)
class _GemmaLayer:
    """One decoder layer as the lean loop reads it (the projections as
    :class:`~draftsmith.inference.kernels.direct_forward._LeanLayer` holds them)."""

    norms: tuple[nn.Module, ...]  # input, post-attention, pre-feedforward, post-feedforward, q, k
    factors: tuple[torch.Tensor, ...]  # their 1 + weight
    projections: tuple[nn.Module, ...]  # q, k, v, o, gate, up, down
    one_row: tuple[Callable[[torch.Tensor], torch.Tensor], ...]  # their one-row products, in the same order
    act: Callable[[torch.Tensor], torch.Tensor]
    attention: nn.Module
    kind: str  # the layer type: its rotary embedding and mask
    heads: int
    kv_heads: int
    widths: tuple[int, ...]  # q, k, v, gate and up's outputs: the stacked products' columns


def _gemma_plan(layers: list[nn.Module], kinds: tuple[str, ...]) -> list[_GemmaLayer]:
    plan = []
    for layer, kind in zip(layers, kinds, strict=True):
        projections = projections_of(layer.self_attn, layer.mlp)
        transposed = [linear.weight.t() for linear in projections]
        attention = layer.self_attn
        norms = (
            layer.input_layernorm,
            layer.post_attention_layernorm,
            layer.pre_feedforward_layernorm,
            layer.post_feedforward_layernorm,
            attention.q_norm,
            attention.k_norm,
        )
        plan.append(
            _GemmaLayer(
                norms,
                tuple(_factor(norm) for norm in norms),
                projections,
                tuple(partial(torch.mm, mat2=weight) for weight in transposed),
                layer.mlp.act_fn.forward,
                attention,
                kind,
                transposed[0].shape[1] // attention.head_dim,
                transposed[1].shape[1] // attention.head_dim,
                tuple(transposed[j].shape[1] for j in (0, 1, 2, 4, 5)),
            )
        )
    return plan


def _gemma_native_plan(steps: list[_GemmaLayer]) -> NativePlan | None:
    """What ``gemma_layers`` reads per layer: the input norm's factor, the seven projections' transposed
    weights, the other five norms' factors (``native.cpp``'s GemmaWeight order), the six epsilons; None
    where the layers' attention shapes differ (the extension takes one)."""
    first = steps[0].attention
    if any(
        (s.heads, s.kv_heads, s.attention.head_dim, s.attention.scaling)
        != (steps[0].heads, steps[0].kv_heads, first.head_dim, first.scaling)
        for s in steps
    ):
        return None
    weights: list[torch.Tensor] = []
    eps: list[float] = []
    for step in steps:
        weights += [step.factors[0], *(linear.weight.t() for linear in step.projections), *step.factors[1:]]
        eps += [norm.eps for norm in step.norms]
    linears = [linear for step in steps for linear in step.projections]
    siblings = [group for step in steps for group in (step.projections[:3], step.projections[4:6])]
    return NativePlan(weights, eps, linears, siblings, steps[0].heads, steps[0].kv_heads, first.head_dim, first.scaling)


def _gemma_layers(
    steps: list[_GemmaLayer],
    stacks: Stacks | None,
    x: torch.Tensor,
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]],
    masks: LayerMasks,
    cache: PreallocatedCache,
    hidden: list[torch.Tensor],
    attention_function: Callable[..., tuple[torch.Tensor, None]],
) -> torch.Tensor:
    """Every decoder layer (see the module docstring); ``hidden`` gets each layer's output. ``stacks``:
    each layer's stacked q|k|v and gate|up packs, whose one product gives the separate ones' columns."""
    rows, width = x.shape[1], x.shape[2]
    kernel, stacked = stacks if stacks is not None else (None, None)
    for i, step in enumerate(steps):
        attention, eps = step.attention, step.norms[0].eps
        head_dim = attention.head_dim
        cos, signed_sin = factors[step.kind]
        half = head_dim // 2
        q, k, v, o, gate, up, down = _projectors(step, rows)
        qkv, gate_up = stacked[i] if stacked is not None else (None, None)
        input_factor, post_attention_factor, pre_feedforward_factor, post_feedforward_factor, q_factor, k_factor = (
            step.factors
        )
        row = _rms_norm(x, eps, input_factor).view(rows, width)
        if qkv is not None:
            query, key, value = one_pack_product(kernel, row, qkv).split(step.widths[:3], dim=1)
        else:
            query, key, value = q(row), k(row), v(row)
        query = query.view(1, rows, step.heads, head_dim).transpose(1, 2)
        key = key.view(1, rows, step.kv_heads, head_dim).transpose(1, 2)
        value = value.view(1, rows, step.kv_heads, head_dim).transpose(1, 2)
        query = _rms_norm(query, attention.q_norm.eps, q_factor)
        key = _rms_norm(key, attention.k_norm.eps, k_factor)
        query = (query * cos) + (torch.roll(query, half, -1) * signed_sin)
        key = (key * cos) + (torch.roll(key, half, -1) * signed_sin)
        keys, values = cache.layers[attention.layer_idx].update(key, value)
        out = attention_function(
            attention,
            query,
            keys,
            values,
            masks[step.kind],
            dropout=0.0,
            scaling=attention.scaling,
            sliding_window=attention.sliding_window,
        )[0]
        x = x + _rms_norm(o(out.view(rows, -1)), step.norms[1].eps, post_attention_factor)
        row = _rms_norm(x, step.norms[2].eps, pre_feedforward_factor).view(rows, width)
        if gate_up is not None:
            gated, upped = one_pack_product(kernel, row, gate_up).split(step.widths[3:], dim=1)
        else:
            gated, upped = gate(row), up(row)
        x = x + _rms_norm(down(step.act(gated) * upped), step.norms[3].eps, post_feedforward_factor)
        hidden.append(x)
    return x
