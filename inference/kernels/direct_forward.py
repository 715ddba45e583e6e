"""The target's verification forward without transformers' per-call machinery, bit for bit the same.

On a CPU, a small model's one-token forward spends a visible share of its time around the matrix
multiplies, and part of that is not arithmetic: output-capturing hooks and decorators, mask preparation,
keyword plumbing through three module levels per layer, the attention-interface lookup. For a Llama
model, :class:`DirectForward` runs the same submodules in the same order (the norms, the projections,
the MLP, the rotary embedding, ``apply_rotary_pos_emb``, the cache's ``update`` and the attention
function: transformers' own ``sdpa_attention_forward``, or the runtime's row-invariant one of
:mod:`attention`, with the model's own forwards switched to it) and leaves that machinery out, so its
logits and hidden states are bitwise those of ``model(...)`` (``tests/test_direct_forward.py``
checks it on one-token and tree forwards). Calling the modules keeps :mod:`packed_gemm`'s linear
swap and any weights the model holds.

The runtime's own forwards (one sequence: a decoding step, or a tree under its mask; the runtime's
preallocated cache) of a bias-free Llama take a shorter path still, :func:`_lean_layers`: the same
operations on the same values in the same order with fewer calls (one row: ``torch.mm`` on transposed
weight views, which is what ``F.linear`` runs for a one-row input; the rotary embedding's sign moved
from ``q`` onto ``sin``, exact; SDPA called as the wrapper calls it; the layer's cache written
directly). ``tests/test_smollm2.py`` checks it bitwise on SmolLM2. Where :mod:`native_layers` can be
built and serves the model, those same operations run as one C++ call (float32 on the CPU).

The runtime uses it for every verification forward of a Llama it supports (:func:`direct.direct_forward_for`,
which gives a Gemma-3 its own, :mod:`gemma_forward`); prefill keeps the model's own forward, where the
arithmetic dwarfs the overhead.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward, use_gqa_in_sdpa
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    apply_rotary_pos_emb,
)

from draftsmith.core.cache import PreallocatedCache
from draftsmith.core.cache_kwarg import cache_kwargs
from draftsmith.inference.kernels.attention import rows_attention_available, rows_attention_forward
from draftsmith.inference.kernels.native import native_extension
from draftsmith.inference.kernels.native_layers import (
    NativePlan,
    native_decoder_layers,
    native_layers_supported,
    native_plan,
)
from draftsmith.inference.kernels.packed_gemm import active_pack

AttentionFunction = Callable[..., tuple[torch.Tensor, None]]  # transformers' attention-function interface


class DirectForward:
    """``forward(input_ids, position_ids, attention_mask, cache, output_hidden_states)`` of a
    :class:`~transformers.LlamaForCausalLM`, equal to ``model(input_ids, attention_mask=...,
    position_ids=..., **cache_kwargs(cache), use_cache=True, output_hidden_states=...)`` when the mask
    is None (every cached key is seen: a one-token step) or a 4D additive mask over ``past + T`` keys."""

    def __init__(self, model: LlamaForCausalLM, native: bool = True, rows_attention: bool | None = None) -> None:
        """``native``: lean forwards run the layers as one C++ call where :mod:`native_layers` serves the
        model (built on first use; bitwise the same). ``rows_attention`` (by default, ``native``): every
        forward attends through the row-invariant attention (:mod:`attention`) where it serves the model;
        the model's own forwards then compute the same inside
        :func:`~draftsmith.inference.kernels.attention.model_attention`."""
        self.model = model
        self.rows_attention = rows_attention_available(model, native if rows_attention is None else rows_attention)
        self._attention_function = rows_attention_forward if self.rows_attention else sdpa_attention_forward
        self.layers: list[LlamaDecoderLayer] = list(model.model.layers[: model.config.num_hidden_layers])
        self._steps: list[_LeanLayer] | None = None
        self._steps_from = PlanSources()
        weight = model.lm_head.weight
        served = native and native_layers_supported(self.layers, weight.dtype, weight.device)
        self._native = native_extension() if served else None
        self._native_plan: NativePlan | None = None
        self._rotary = RotaryTable()

    def __call__(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache,
        output_hidden_states: bool = False,
        head: bool = True,
    ) -> CausalLMOutputWithPast | BaseModelOutputWithPast:
        """The model's output; with ``head=False``, the forward up to the ``lm_head``, as the base model
        returns it (``last_hidden_state``: the normed last states, the head's input)."""
        base = self.model.model
        x = base.embed_tokens(input_ids)
        hidden: list[torch.Tensor] = [x]
        steps = self._lean_steps(x, attention_mask, cache)
        layers = self._native_layers(x, position_ids, attention_mask, cache) if steps is not None else None
        if layers is not None:
            hidden.extend(layers)
            x = layers[-1]
        else:
            position_embeddings = base.rotary_emb(x, position_ids=position_ids)
            if steps is not None:
                x = _lean_layers(steps, x, position_embeddings, attention_mask, cache, hidden, self._attention_function)
            else:
                for layer in self.layers:
                    x = _decoder_layer(layer, x, position_embeddings, attention_mask, cache, self._attention_function)
                    hidden.append(x)
        if layers is None:
            x = base.norm(x)
        else:  # the extension's RMSNorm: the same floats without a module call and its small ATen calls
            x = self._native.rms_norm(x, base.norm.weight, base.norm.variance_epsilon)
        hidden[-1] = x  # transformers reports the normed last state as the last hidden state
        states = tuple(hidden) if output_hidden_states else None
        if not head:
            return BaseModelOutputWithPast(last_hidden_state=x, **cache_kwargs(cache), hidden_states=states)
        return CausalLMOutputWithPast(logits=self.model.lm_head(x), **cache_kwargs(cache), hidden_states=states)

    @staticmethod
    def serves(model: nn.Module) -> bool:
        """Every Llama: the general loop computes what the lean one does not (biases, other caches)."""
        return True

    @property
    def native(self) -> bool:
        """Whether lean forwards run the C++ layers (:mod:`native_layers`)."""
        return self._native is not None

    @property
    def extension(self) -> ModuleType | None:
        """The runtime's C++ extension where this forward uses it (:mod:`native`)."""
        return self._native

    def _lean_steps(self, x: torch.Tensor, attention_mask: torch.Tensor | None, cache) -> list | None:
        """The lean plan when this forward is one the runtime makes (one sequence; one row without a mask
        or rows under a tree mask; its preallocated cache) of a model the plan serves; rebuilt when a
        parameter or submodule of a layer was replaced."""
        one_token = x.shape[1] == 1 and attention_mask is None
        if x.shape[0] != 1 or not (one_token or attention_mask is not None):
            return None
        if not isinstance(cache, PreallocatedCache):
            return None
        if self._steps is None or not self._steps_from.current():
            self._steps, self._steps_from = _lean_plan(self.layers), PlanSources(self.layers)
            self._native_plan = native_plan(self.layers) if self._native is not None and self._steps else None
        return self._steps or None

    def _native_layers(
        self, x: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None, cache
    ) -> list[torch.Tensor] | None:
        """Each layer's output from the C++ layers, for a lean forward (after :meth:`_lean_steps` accepted
        it) they can run: float32 on the CPU, a cache that already holds the prompt, and SDPA reading
        grouped K/V heads as they are; else None, with nothing done."""
        if self._native is None or self._native_plan is None or x.dtype != torch.float32 or x.device.type != "cpu":
            return None
        if not cache.layers[0].is_initialized:
            return None
        cos, signed_sin = self._rotary.factors(self.model.model.rotary_emb, x, position_ids)
        return native_decoder_layers(
            self._native, self._native_plan, x, cos, signed_sin, attention_mask, cache.layers, self.rows_attention
        )


def _decoder_layer(
    layer: LlamaDecoderLayer,
    x: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None,
    cache,
    attention_function: AttentionFunction,
) -> torch.Tensor:
    attended = _attention(
        layer.self_attn,
        _rms_norm(layer.input_layernorm, x),
        position_embeddings,
        attention_mask,
        cache,
        attention_function,
    )
    x = x + attended
    return x + _mlp(layer.mlp, _rms_norm(layer.post_attention_layernorm, x))


def _rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``LlamaRMSNorm.forward``, the same operations in the same order."""
    dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    return norm.weight * (h * torch.rsqrt(variance + norm.variance_epsilon)).to(dtype)


def _mlp(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``LlamaMLP.forward``; calling each module's ``forward`` skips ``nn.Module``'s call wrapper,
    which costs as much as a small kernel (modules with hooks never get here)."""
    return mlp.down_proj.forward(mlp.act_fn.forward(mlp.gate_proj.forward(x)) * mlp.up_proj.forward(x))


def _attention(
    attention: nn.Module,
    x: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None,
    cache,
    attention_function: AttentionFunction,
) -> torch.Tensor:
    input_shape = x.shape[:-1]
    hidden_shape = (*input_shape, -1, attention.head_dim)
    query = attention.q_proj.forward(x).view(hidden_shape).transpose(1, 2)
    key = attention.k_proj.forward(x).view(hidden_shape).transpose(1, 2)
    value = attention.v_proj.forward(x).view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    query, key = apply_rotary_pos_emb(query, key, cos, sin)
    key, value = cache.update(key, value, attention.layer_idx)
    out, _ = attention_function(attention, query, key, value, attention_mask, scaling=attention.scaling)
    return attention.o_proj.forward(out.reshape(*input_shape, -1).contiguous())


@dataclass(frozen=True)
class _LeanLayer:
    """One decoder layer as the lean path reads it: the projections (their modules, for multi-row
    forwards through :mod:`packed_gemm`, and for one row ``torch.mm`` on their weights transposed, the
    call ``F.linear`` makes for a one-row input without bias; views, so in-place updates show through)."""

    input_norm: nn.Module
    projections: tuple[nn.Module, ...]  # q, k, v, o, gate, up, down
    one_row: tuple[Callable[[torch.Tensor], torch.Tensor], ...]  # their one-row products, in the same order
    post_norm: nn.Module
    act: Callable[[torch.Tensor], torch.Tensor]
    attention: nn.Module
    heads: int
    kv_heads: int


def _lean_plan(layers: list[LlamaDecoderLayer]) -> list[_LeanLayer]:
    """The plan, or [] where a layer has something the lean path does not do (biases)."""
    plan = []
    for layer in layers:
        attention, mlp = layer.self_attn, layer.mlp
        projections = (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj)
        projections += (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        if any(linear.bias is not None for linear in projections):
            return []
        transposed = [linear.weight.t() for linear in projections]
        plan.append(
            _LeanLayer(
                layer.input_layernorm,
                projections,
                tuple(partial(torch.mm, mat2=weight) for weight in transposed),
                layer.post_attention_layernorm,
                mlp.act_fn.forward,
                attention,
                transposed[0].shape[1] // attention.head_dim,
                transposed[1].shape[1] // attention.head_dim,
            )
        )
    return plan


def _lean_layers(
    steps: list[_LeanLayer],
    x: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None,
    cache,
    hidden: list[torch.Tensor],
    attention_function: AttentionFunction,
) -> torch.Tensor:
    """Every decoder layer: the operations of :func:`_decoder_layer` on the same values in the same
    order, with fewer calls. Projections run on the rows as a matrix (one row: ``torch.mm``, what
    ``F.linear`` runs; more: the module, packed or not, as before); the rotary embedding's
    ``rotate_half(q) * sin`` is ``roll(q) * sin'`` with ``sin'``'s first half negated (a sign moved
    between exact factors); attention is ``attention_function``'s (SDPA called exactly as transformers'
    wrapper calls it for these inputs, or the row-invariant attention).
    ``hidden`` gets each layer's output."""
    cos, signed_sin = _rotary_factors(position_embeddings)
    half = signed_sin.shape[-1] // 2
    rows, width = x.shape[1], x.shape[2]
    for step in steps:
        attention = step.attention
        q, k, v, o, gate, up, down = _projectors(step, rows)
        row = _rms_norm(step.input_norm, x).view(rows, width)
        query = q(row).view(1, rows, step.heads, attention.head_dim).transpose(1, 2)
        key = k(row).view(1, rows, step.kv_heads, attention.head_dim).transpose(1, 2)
        value = v(row).view(1, rows, step.kv_heads, attention.head_dim).transpose(1, 2)
        query = (query * cos) + (torch.roll(query, half, -1) * signed_sin)
        key = (key * cos) + (torch.roll(key, half, -1) * signed_sin)
        keys, values = cache.layers[attention.layer_idx].update(key, value)
        if attention_function is sdpa_attention_forward:
            out = _sdpa(attention, query, keys, values, attention_mask)
        else:
            out = attention_function(attention, query, keys, values, attention_mask, scaling=attention.scaling)[0]
        x = x + o(out.view(rows, -1))
        row = _rms_norm(step.post_norm, x).view(rows, width)
        x = x + down(step.act(gate(row)) * up(row))
        hidden.append(x)
    return x


class PlanSources:
    """Every submodule and parameter slot of some layers with what it holds now: a plan made from them is
    current while each slot still holds the same object (far cheaper per forward than walking
    ``model.parameters()``; SmolLM2's 30 layers hold 840 slots). One class for every direct forward."""

    def __init__(self, layers: Iterable[nn.Module] = ()) -> None:
        self._tables: list[dict] = []
        self._names: list[str] = []
        self._held: list[object] = []
        for layer in layers:
            for module in layer.modules():
                for table in (module._modules, module._parameters):
                    self._tables += [table] * len(table)
                    self._names += list(table)
                    self._held += list(table.values())

    def current(self) -> bool:
        """Whether every slot still holds what it held when these sources were read."""
        return all(map(operator.is_, map(dict.get, self._tables, self._names), self._held))


def _rotary_factors(position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` shaped as ``apply_rotary_pos_emb`` broadcasts them, with the first half of
    ``sin`` negated: ``rotate_half(q) * sin == roll(q, half) * signed_sin``."""
    cos, sin = position_embeddings
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = sin.shape[-1] // 2
    return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


class RotaryTable:
    """The C++ layers' rotary factors (:func:`_rotary_factors` of the rotary embedding's ``cos`` and ``sin``) for
    every position up to a length, made by the module itself and read by index: a decoding step then looks
    its rows up instead of calling the module and four tensor operations. The module computes each element
    alone (a position times an inverse frequency, then its cosine or sine, which ATen computes with one
    vector function for every element, a vector's tail included), so a row's floats do not depend on which
    other positions shared its call (``tests/test_direct_forward.py`` checks every row against the module,
    for head sizes at and off a vector's width). Made again when the module, its inverse frequencies (in
    place too) or its scaling change, or a position is past the end (the length doubles); a rotary
    embedding of another kind (transformers' dynamic types change with the positions asked for) is called
    every time."""

    BLOCK = 128  # positions per module call while making the table

    def __init__(self) -> None:
        self._source: tuple | None = None
        self._cos = self._signed_sin = torch.empty(0)

    def factors(
        self, rotary: nn.Module, x: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``_rotary_factors(rotary(x, position_ids))`` for one sequence's positions (1, rows)."""
        inv_freq = getattr(rotary, "inv_freq", None)
        if getattr(rotary, "rope_type", None) != "default" or inv_freq is None or position_ids.shape[0] != 1:
            return _rotary_factors(rotary(x, position_ids=position_ids))
        source = (rotary, inv_freq, inv_freq._version, rotary.attention_scaling, x.dtype, x.device)
        same = self._source is not None and all(map(operator.is_, source[:2], self._source[:2]))
        same = same and source[2:] == self._source[2:]
        last = int(position_ids.max())
        if not same or last >= self._cos.shape[0]:
            length = max(self._cos.shape[0] if same else 0, self.BLOCK)
            while length <= last:
                length *= 2
            self._cos, self._signed_sin = self._made(rotary, x, length)
            self._source = source
        rows = position_ids[0]
        shape = (1, 1, rows.shape[0], self._cos.shape[1])
        return self._cos.index_select(0, rows).view(shape), self._signed_sin.index_select(0, rows).view(shape)

    def _made(self, rotary: nn.Module, x: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        cos, signed_sin = [], []
        with torch.no_grad():
            for start in range(0, length, self.BLOCK):
                positions = torch.arange(start, start + self.BLOCK, device=x.device)[None]
                block_cos, block_sin = _rotary_factors(rotary(x, position_ids=positions))
                cos.append(block_cos[0, 0])
                signed_sin.append(block_sin[0, 0])
        return torch.cat(cos), torch.cat(signed_sin)


def _projectors(step: _LeanLayer, rows: int) -> tuple[Callable[[torch.Tensor], torch.Tensor], ...]:
    """One row without a pack: the prepared products. Otherwise each module's ``forward``, looked up
    now, since :mod:`packed_gemm` may have turned the module into a packed linear after the plan was made."""
    if rows == 1 and active_pack(step.projections[0], 1) is None:
        return step.one_row
    return tuple(linear.forward for linear in step.projections)


def _sdpa(
    attention: nn.Module,
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    attention_mask: torch.Tensor | None,
) -> torch.Tensor:
    """``sdpa_attention_forward`` for one sequence whose queries see the cache through ``attention_mask``
    (or, one query, see all of it): ``(1, rows, heads, head_dim)``, contiguous."""
    if attention.num_key_value_groups > 1 and not use_gqa_in_sdpa(attention_mask, keys, values):
        # the wrapper's other branches (one query packs its heads, more repeat the K/V heads)
        return sdpa_attention_forward(attention, query, keys, values, attention_mask, scaling=attention.scaling)[0]
    grouped = {"enable_gqa": True} if attention.num_key_value_groups > 1 else {}
    out = F.scaled_dot_product_attention(
        query, keys, values, attn_mask=attention_mask, scale=attention.scaling, is_causal=False, **grouped
    )
    return out.transpose(1, 2).contiguous()
