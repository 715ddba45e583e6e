"""The training-time test's attention without its dense mask (EAGLE-3, FSPAD-3, P-EAGLE training).

Step ``i`` of the training-time test attends from every position ``t`` to step 0's keys at positions up to
``t`` and to its own position's key of each step ``1..i``: a causal block followed by ``i`` diagonals.
Written as one dense ``(T, (i + 1) T)`` mask, SDPA computes every masked score too: ``i + 1`` times the
work of a causal block, through the CPU's masked flash-attention path, which on a CPU was ~40% of an
offline EAGLE-3 step. :class:`TTTMask` says what the mask is instead, and the attention function
registered here (the drafters' layers name it, :data:`ATTENTION`) computes the causal block in chunks
of query rows that skip the keys after them, and each diagonal as one dot product per position, then
one softmax over both. Its results equal the dense mask's up to float rounding. Other masks, and
tensors off the CPU, take transformers' SDPA as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from draftsmith.core.tree import causal_allowed, causal_mask

ATTENTION = "draftsmith_ttt"  # the name the drafters' layer configs select this attention by
_TILE_ELEMENTS = 1 << 23  # the score tile of one chunk of query rows (all samples and heads), in elements


@dataclass(frozen=True)
class TTTMask:
    """The mask of training-time-test step ``step``: query ``t`` sees step 0's keys at positions ``<= t``
    that are real (``key_padding`` (B, T) 1/0, where a query row with none sees its own key) and its own
    position's key of every step ``1..step``; the keys are the steps' keys in order, as the cache holds them."""

    key_padding: torch.Tensor
    step: int

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The same mask as a (B, 1, T, (step + 1) T) additive tensor."""
        length, device = self.key_padding.shape[1], self.key_padding.device
        causal = causal_mask(length, dtype, device, self.key_padding)
        own = torch.full_like(causal[:1], torch.finfo(dtype).min)
        own.diagonal(dim1=2, dim2=3).zero_()
        return torch.cat([causal, *[own.expand_as(causal)] * self.step], dim=-1)

    def causal_rows(self, begin: int, end: int) -> torch.Tensor:
        """(B, 1, end - begin, end) bool: which of step 0's keys before ``end`` query rows ``begin..end`` see."""
        return causal_allowed(begin, end, self.key_padding.device, self.key_padding)


def ttt_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | TTTMask | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: a :class:`TTTMask` on the CPU takes :class:`_TTTAttention`, every
    other call SDPA (a TTTMask elsewhere as its dense tensor)."""
    if not isinstance(attention_mask, TTTMask):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if query.device.type != "cpu" or dropout:
        dense = attention_mask.dense(query.dtype)
        return sdpa_attention_forward(module, query, key, value, dense, dropout, scaling, **kwargs)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    if torch.is_autocast_enabled("cpu"):  # as autocast runs SDPA: every input in its dtype
        dtype = torch.get_autocast_dtype("cpu")
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    out = _TTTAttention.apply(query, key, value, attention_mask, scale)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, ttt_attention_forward)


@dataclass(frozen=True)
class _Shapes:
    batch: int
    kv_heads: int
    group: int  # query heads per key/value head
    length: int  # T
    steps: int  # diagonal steps 1..step
    dim: int

    @classmethod
    def of(cls, query: torch.Tensor, key: torch.Tensor) -> _Shapes:
        batch, heads, length, dim = query.shape
        return cls(batch, key.shape[1], heads // key.shape[1], length, key.shape[2] // length - 1, dim)

    def rows_of(self, grouped: torch.Tensor, begin: int, end: int) -> torch.Tensor:
        """(B, KV, G (end - begin), D): query rows ``begin..end`` of (B, KV, G, T, D), a K/V head's query heads
        stacked, so one product serves them all."""
        return grouped[:, :, :, begin:end].reshape(self.batch, self.kv_heads, -1, self.dim)

    def chunk(self) -> int:
        return max(16, _TILE_ELEMENTS // max(1, self.batch * self.kv_heads * self.group * self.length))


def _split(tensor: torch.Tensor, shapes: _Shapes) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache's keys or values (B, KV, (steps + 1) T, D) as step 0's (B, KV, T, D), in their dtype, and the
    diagonal steps' (B, KV, steps, T, D), float32."""
    first = tensor[:, :, : shapes.length].contiguous()
    later = tensor[:, :, shapes.length :].reshape(*first.shape[:2], shapes.steps, shapes.length, shapes.dim)
    return first, later.float()


@dataclass(frozen=True)
class _Operands:
    """One call's inputs as both passes read them: the query grouped (B, KV, G, T, D) by K/V head, and step 0's
    and the diagonal steps' keys and values (:func:`_split`)."""

    shapes: _Shapes
    grouped: torch.Tensor
    keys: torch.Tensor
    key_diagonals: torch.Tensor
    values: torch.Tensor
    value_diagonals: torch.Tensor

    @classmethod
    def of(cls, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> _Operands:
        shapes = _Shapes.of(query, key)
        grouped = query.reshape(shapes.batch, shapes.kv_heads, shapes.group, shapes.length, shapes.dim)
        return cls(shapes, grouped, *_split(key, shapes), *_split(value, shapes))

    def chunks(self):
        """(begin, end) of each chunk of query rows."""
        step = self.shapes.chunk()
        for begin in range(0, self.shapes.length, step):
            yield begin, min(begin + step, self.shapes.length)


class _TTTAttention(torch.autograd.Function):
    """softmax over [causal block | diagonals] times the values, recomputed chunk by chunk in the backward
    (flash attention's scheme: only the output and each row's log-sum-exp are kept). Products run in the
    inputs' dtype (bf16 under autocast), softmax arithmetic in float32."""

    @staticmethod
    def forward(ctx, query, key, value, mask: TTTMask, scale: float):
        gemm = query.dtype
        with torch.autocast(query.device.type, enabled=False):
            ops = _Operands.of(query, key, value)
            shapes = ops.shapes
            out = query.new_empty(ops.grouped.shape, dtype=torch.float32)
            logsumexp = query.new_empty(ops.grouped.shape[:-1], dtype=torch.float32)
            for begin, end in ops.chunks():
                rows = shapes.rows_of(ops.grouped, begin, end) * scale
                scores, diagonal = _scores(rows, ops, mask, begin, end)
                top = torch.maximum(scores.amax(-1), diagonal.amax(-1)) if shapes.steps else scores.amax(-1)
                weights = scores.sub_(top[..., None]).exp_()
                diagonal = diagonal.sub_(top[..., None]).exp_()
                total = weights.sum(-1) + diagonal.sum(-1)
                attended = torch.matmul(weights.to(gemm), ops.values[:, :, :end]).float()
                if shapes.steps:
                    attended += _diagonal_product(diagonal, ops.value_diagonals[:, :, :, begin:end], shapes)
                out[:, :, :, begin:end] = (attended / total[..., None]).view_as(out[:, :, :, begin:end])
                logsumexp[:, :, :, begin:end] = (top + total.log()).view_as(logsumexp[:, :, :, begin:end])
        ctx.save_for_backward(query, key, value, out, logsumexp)
        ctx.mask, ctx.scale = mask, scale
        return out.view(query.shape).to(query.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, logsumexp = ctx.saved_tensors
        mask, scale = ctx.mask, ctx.scale
        gemm = query.dtype
        with torch.autocast(query.device.type, enabled=False):
            ops = _Operands.of(query, key, value)
            shapes = ops.shapes
            grad_grouped = grad_out.reshape(ops.grouped.shape)
            grad_query = torch.empty_like(out)
            grad_keys = ops.keys.new_zeros(ops.keys.shape, dtype=torch.float32)
            grad_values = ops.values.new_zeros(ops.values.shape, dtype=torch.float32)
            grad_key_diagonals = torch.zeros_like(ops.key_diagonals)
            grad_value_diagonals = torch.zeros_like(ops.value_diagonals)
            for begin, end in ops.chunks():
                rows = shapes.rows_of(ops.grouped, begin, end) * scale  # carries the scale into k's gradient too
                grad_rows = shapes.rows_of(grad_grouped, begin, end).float()
                row_lse = logsumexp[:, :, :, begin:end].reshape(shapes.batch, shapes.kv_heads, -1, 1)
                scores, diagonal = _scores(rows, ops, mask, begin, end)
                weights = scores.sub_(row_lse).exp_()
                diagonal = diagonal.sub_(row_lse).exp_()
                # softmax's backward: d score = weight * (d weight - sum(d out * out)); q's gradient is scaled last
                delta = (grad_rows * shapes.rows_of(out, begin, end)).sum(-1, keepdim=True)
                grad_weights = torch.matmul(grad_rows.to(gemm), ops.values[:, :, :end].transpose(-1, -2))
                grad_values[:, :, :end] += _group_sum(weights, grad_rows, gemm)
                grad_scores = grad_weights.float().sub_(delta).mul_(weights).to(gemm)
                grad_rows_query = torch.matmul(grad_scores, ops.keys[:, :, :end]).float()
                grad_keys[:, :, :end] += _group_sum(grad_scores, rows, gemm)
                if shapes.steps:
                    value_diagonal = ops.value_diagonals[:, :, :, begin:end]
                    grad_diagonal = _diagonal_scores(grad_rows, value_diagonal, shapes).sub_(delta).mul_(diagonal)
                    grad_value_diagonals[:, :, :, begin:end] = _diagonal_weighted(diagonal, grad_rows, shapes)
                    grad_key_diagonals[:, :, :, begin:end] = _diagonal_weighted(grad_diagonal, rows.float(), shapes)
                    grad_rows_query += _diagonal_product(grad_diagonal, ops.key_diagonals[:, :, :, begin:end], shapes)
                grad_query[:, :, :, begin:end] = grad_rows_query.view_as(grad_query[:, :, :, begin:end])
            grad_key = torch.cat([grad_keys, grad_key_diagonals.flatten(2, 3)], dim=2)
            grad_value = torch.cat([grad_values, grad_value_diagonals.flatten(2, 3)], dim=2)
        grad_query = grad_query.mul_(scale).view(query.shape)
        return grad_query.to(query.dtype), grad_key.to(key.dtype), grad_value.to(value.dtype), None, None


def _scores(rows: torch.Tensor, ops: _Operands, mask: TTTMask, begin: int, end: int):
    """Query rows ``begin..end`` (scaled)'s scores, float32: (B, KV, G c, end) over step 0's keys before ``end``
    (masked ones -inf) and (B, KV, G c, steps) over their own positions' keys of the diagonal steps."""
    shapes = ops.shapes
    scores = torch.matmul(rows, ops.keys[:, :, :end].transpose(-1, -2)).float()
    grid = scores.view(shapes.batch, shapes.kv_heads, shapes.group, end - begin, end)
    # keys before the chunk's rows are hidden only where padded; the causal part is the chunk's own block
    grid[..., begin:].masked_fill_(~mask.causal_rows(begin, end)[:, :, None, :, begin:], float("-inf"))
    padded = ~mask.key_padding[:, :begin].bool()
    if padded.any():
        grid[..., :begin].masked_fill_(padded[:, None, None, None], float("-inf"))
    diagonal = _diagonal_scores(rows.float(), ops.key_diagonals[:, :, :, begin:end], shapes)
    return scores, diagonal


def _diagonal_scores(rows: torch.Tensor, diagonals: torch.Tensor, shapes: _Shapes) -> torch.Tensor:
    """(B, KV, G c, steps): each row's dot product with its own position's vector of every diagonal step;
    ``rows`` (B, KV, G c, D), ``diagonals`` (B, KV, steps, c, D)."""
    grouped = rows.view(shapes.batch, shapes.kv_heads, shapes.group, -1, 1, shapes.dim)
    return (grouped * _by_position(diagonals)).sum(-1).flatten(2, 3)


def _diagonal_product(weights: torch.Tensor, diagonals: torch.Tensor, shapes: _Shapes) -> torch.Tensor:
    """(B, KV, G c, D): each row's weights over the diagonal steps (B, KV, G c, steps) times their vectors."""
    grouped = weights.view(shapes.batch, shapes.kv_heads, shapes.group, -1, shapes.steps, 1)
    return (grouped * _by_position(diagonals)).sum(-2).flatten(2, 3)


def _diagonal_weighted(weights: torch.Tensor, rows: torch.Tensor, shapes: _Shapes) -> torch.Tensor:
    """(B, KV, steps, c, D): the gradient a diagonal step's vectors get, summed over the query heads."""
    grouped_weights = weights.view(shapes.batch, shapes.kv_heads, shapes.group, -1, shapes.steps, 1)
    grouped_rows = rows.view(shapes.batch, shapes.kv_heads, shapes.group, -1, 1, shapes.dim)
    return (grouped_weights * grouped_rows).sum(2).transpose(2, 3)


def _by_position(diagonals: torch.Tensor) -> torch.Tensor:
    """(B, KV, 1, c, steps, D): the diagonal steps' vectors (B, KV, steps, c, D) by position, for broadcasting
    over a K/V head's query heads."""
    return diagonals.transpose(2, 3)[:, :, None]


def _group_sum(weights: torch.Tensor, rows: torch.Tensor, gemm: torch.dtype) -> torch.Tensor:
    """(B, KV, keys, D): weights (B, KV, G c, keys) transposed times rows (B, KV, G c, D), which sums over a
    K/V head's query heads and rows in one product."""
    return torch.matmul(weights.to(gemm).transpose(-1, -2), rows.to(gemm)).float()
