"""The direct forward's lean decoder layers as one C++ call (:mod:`native`), bitwise the same.

The lean Python loop (:func:`direct_forward._lean_layers`) makes ~1,000 small ATen calls per forward,
and on a CPU the interpreter's time between them is a visible share of a small model's step.
``native.cpp``'s ``decoder_layers`` makes the same ATen calls (the prepacked linear of :mod:`packed_gemm`'s
kernel where its pack for the rows is active) on the same values in the same order from C++, so the
results are bitwise those of the Python loop (``tests/test_native_layers.py`` checks logits, every
hidden state and the cache).

It serves the lean path's forwards (one sequence on the runtime's preallocated cache: decoding steps
and tree verifications) of float32 CPU Llama layers without biases whose MLP is SiLU-gated, where SDPA
reads grouped K/V heads as they are; anything else takes the Python loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType

import torch
from torch import nn
from transformers.activations import SiLUActivation
from transformers.integrations.sdpa_attention import use_gqa_in_sdpa

from draftsmith.core.cache import PreallocatedLayer
from draftsmith.inference.kernels.packed_gemm import PackedGemm, PackedLinear, active_pack, pack_kind

_WEIGHTS_PER_LAYER = 9  # the order of native.cpp's Weight enum


def native_layers_supported(layers: list[nn.Module], dtype: torch.dtype, device: torch.device) -> bool:
    """Layers :func:`native_decoder_layers` computes bitwise as the Python loop does."""
    if dtype != torch.float32 or device.type != "cpu" or not layers:
        return False
    for layer in layers:
        attention = layer.self_attn
        if not silu_gated(layer.mlp):
            return False
        if attention.num_key_value_groups > 1 and attention.head_dim > 256:
            return False  # use_gqa_in_sdpa says no there: transformers' wrapper packs the heads instead
    return True


def silu_gated(mlp: nn.Module) -> bool:
    """Whether ``mlp``'s activation is the SiLU the extension's gated product computes: not another one,
    nor a hub kernel swapped into this instance."""
    act = mlp.act_fn
    return type(act) in (SiLUActivation, nn.SiLU) and "forward" not in vars(act)


@dataclass
class PackReads:
    """What :func:`pack_inputs` keeps between forwards for one plan: the packs, their kinds and the stacked
    packs a forward passes, by the state of the packs they were read from (:func:`_pack_state`; reading them
    costs ~500 Python calls, and they change only when packs do), and the plan's linears' owners with the
    ``PackedGemm.ownership_changes`` they were read at (no linear changes hands while it stays)."""

    inputs: dict = field(default_factory=dict)
    owners: tuple = ()
    owners_read_at: int = -1


@dataclass(frozen=True)
class NativePlan:
    """What the extension reads on every forward, gathered once per lean plan: per layer, in the
    extension's order, the input norm's weight, the seven projections' weights transposed (views, so
    in-place updates show through) and the post-attention norm's weight; the norms' epsilons; the
    projection modules (for their active packs); the attention's shape."""

    weights: list[torch.Tensor]
    eps: list[float]
    linears: list[nn.Module]
    siblings: list[tuple[nn.Module, ...]]  # per layer: (q, k, v) and (gate, up), which read one input
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    reads: PackReads = field(default_factory=PackReads)


def native_plan(layers: list[nn.Module]) -> NativePlan:
    weights: list[torch.Tensor] = []
    eps: list[float] = []
    linears: list[nn.Module] = []
    siblings: list[tuple[nn.Module, ...]] = []
    for layer in layers:
        projections = projections_of(layer.self_attn, layer.mlp)
        linears += projections
        siblings += [projections[:3], projections[4:6]]
        weights += [layer.input_layernorm.weight, *(linear.weight.t() for linear in projections)]
        weights.append(layer.post_attention_layernorm.weight)
        eps += [layer.input_layernorm.variance_epsilon, layer.post_attention_layernorm.variance_epsilon]
    assert len(weights) == _WEIGHTS_PER_LAYER * len(layers)
    attention = layers[0].self_attn
    head_dim = attention.head_dim
    heads, kv_heads = weights[1].shape[1] // head_dim, weights[2].shape[1] // head_dim
    return NativePlan(weights, eps, linears, siblings, heads, kv_heads, head_dim, attention.scaling)


def native_decoder_layers(
    extension: ModuleType,
    plan: NativePlan,
    x: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cache_layers: list[PreallocatedLayer],
    rows_attention: bool = False,
) -> list[torch.Tensor] | None:
    """Every layer on ``x`` (1, rows, width), appending its key and value rows to the cache; each layer's
    output, or None (nothing done) where transformers would repeat grouped K/V heads instead of letting
    SDPA read them grouped (a mask without the runtime's switch, see ``runtime._grouped_kv_heads``).
    ``cos`` and ``signed_sin`` as :func:`direct_forward._lean_layers` makes them; projections whose
    :class:`~draftsmith.inference.kernels.packed_gemm.PackedLinear` has an active pack for these rows use it.
    ``rows_attention``: attention through the extension's row-invariant ``attend`` (:mod:`attention`),
    which reads grouped K/V heads under any mask."""
    grouped = plan.heads != plan.kv_heads
    if (
        grouped
        and not rows_attention
        and not use_gqa_in_sdpa(attention_mask, cache_layers[0].keys, cache_layers[0].values)
    ):
        return None
    rows = x.shape[1]
    packs, kinds, fused = pack_inputs(plan, rows)
    rooms = [layer.append_rows(rows) for layer in cache_layers]
    return extension.decoder_layers(
        x,
        plan.weights,
        packs,
        plan.eps,
        cos,
        signed_sin,
        attention_mask,
        [room[0] for room in rooms],
        [room[1] for room in rooms],
        rooms[0][2],
        plan.heads,
        plan.kv_heads,
        plan.head_dim,
        plan.scaling,
        grouped,
        kinds,
        fused,
        rows_attention,
    )


_NO_PACK = torch.empty(0)  # the extension's "not packed"
_KEPT_PACK_STATES = 8  # pack states whose inputs a plan keeps (MKL: one per row bucket)


def pack_inputs(plan: NativePlan, rows: int) -> tuple[list[torch.Tensor], list[int], list[torch.Tensor]]:
    """Each projection's active pack for ``rows`` rows and its kind, and each sibling group's stacked
    pack: read again only when the packs may have changed."""
    state = _pack_state(plan, rows)
    kept = plan.reads.inputs
    made = kept.get(state) if state is not None else None
    if made is None:
        packs = [_active_pack(linear, rows) for linear in plan.linears]
        kinds = [pack_kind(linear) for linear in plan.linears]
        fused = [stacked_pack(group) for group in plan.siblings]
        made = (packs, kinds, fused)
        if state is not None:
            if len(kept) >= _KEPT_PACK_STATES:
                kept.clear()
            kept[_pack_state(plan, rows)] = made  # the state after any stacked pack made now
    return made


def _pack_state(plan: NativePlan, rows: int) -> tuple | None:
    """What the pack inputs of a ``rows``-row forward depend on: the one owner of the plan's packed
    linears (its generation, whether its packs are active, which pack ``rows`` rows take) and autograd;
    None (not cached) where the linears have several owners."""
    reads = plan.reads
    if reads.owners_read_at != PackedGemm.ownership_changes:
        found = {id(getattr(linear, "_owner", None)): getattr(linear, "_owner", None) for linear in plan.linears}
        reads.owners, reads.owners_read_at = tuple(found.values()), PackedGemm.ownership_changes
    if len(reads.owners) != 1:
        return None
    owner = reads.owners[0]
    if owner is None:
        return (None, torch.is_grad_enabled())
    return (id(owner), owner.generation, owner.active, owner.pack_key(rows), torch.is_grad_enabled())


def _active_pack(linear: nn.Module, rows: int) -> torch.Tensor:
    pack = active_pack(linear, rows)
    return _NO_PACK if pack is None else pack


def stacked_pack(group: tuple[nn.Module, ...]) -> torch.Tensor:
    """The stacked pack of ``group`` (one product for the layer's q, k, v or gate, up), if any (else an
    empty tensor)."""
    first = group[0]
    pack = first._owner.fused_pack(group) if isinstance(first, PackedLinear) else None
    return _NO_PACK if pack is None else pack


def projections_of(attention: nn.Module, mlp: nn.Module) -> tuple[nn.Module, ...]:
    """q, k, v, o, gate, up, down: the extension's order."""
    return (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj) + (
        mlp.gate_proj,
        mlp.up_proj,
        mlp.down_proj,
    )
