"""Greedy tokens from the target's ``lm_head`` without reading its float32 weights: an int8 screen with
a proof, and the float32 head only where the proof fails.

A one-token forward on a CPU reads every float32 weight once, and for a small model with a large
vocabulary the ``lm_head`` is a large share of them (SmolLM2: 49,152 x 576); greedy decoding needs only
the head's argmax. :class:`GreedyHead` keeps
an int8 copy of the head (a bfloat16 scale per row; a quarter of the bytes) and returns, for each row
``x``, exactly ``argmax(F.linear(x, W))`` as the float32 head computes it:

1. **Screen.** ``a = x' @ (q * s).T`` with a bfloat16 output, where ``x'`` is ``x`` rounded: to 16-bit
   integers times a scale per row where the C++ extension runs (exact integer sums with AVX2, AVX-512 VNNI
   or AMX tiles, the same integers on each, and a ~20x finer input than bfloat16 on SmolLM2's hidden
   states, whose largest value is ~10x their RMS), else to bfloat16 (``torch._weight_int8pack_mm``: float32
   accumulation). For every token ``i`` a bound ``D_i``
   holds: ``|f_i - a_i| <= D_i``, where ``f_i`` is the float32 head's logit in whatever summation order its
   kernel uses (``|f_i - x.W_i| <= gamma_K sum_k |x_k W_ik|``, Higham's bound). ``D_i`` adds the weight rounding
   (``||x|| ||W_i - Q_i||``, Cauchy-Schwarz with the row's measured error), the input's rounding
   (``||x - x'||``, measured), the accumulations and the output rounding (:meth:`GreedyHead.screen_bounds`).
2. **Candidates.** Some token's ``f`` is at least ``L = max_i (a_i - D_i)``; a token with ``a_i + D_i
   < L`` cannot be the argmax. The rest are the candidates (a handful per row on real text).
3. **Proof.** The candidates' logits are recomputed in float64 (``T_i``) with their float32 error
   bound ``B_i = gamma_K sum_k |x_k W_ik|``. If the best one beats every other candidate by more than
   both bounds, it is the float32 argmax, strictly: no tie, no rounding, no summation order changes it.
4. **Fallback.** Otherwise (a near tie, rare on real text; ``bench`` reports how many rows) the row
   takes the float32 head, one row, as plain decoding computes it (the head module itself: through the
   runtime's prepacked linear where that is active).

torch's int8 product reads its weights once per row (the extension's once per forward), so past some rows the
float32 head through a row-invariant prepacked kernel (the stream kernel or oneDNN: every row's logits
bitwise what one row gets, so its argmax is what plain decoding takes, proof or fallback) is faster: with
``full_head_from``, forwards of that many rows or more take it. Where the CPU has AMX (Intel since Sapphire
Rapids), the 16-bit screen's integer sums run on its int8 tiles from ``tiles_from`` rows on (the same integers
as VNNI's, whose multiply-adds bound a screen of many rows; at a few rows reading the weights bounds both).

So the tokens are those of plain greedy decoding (``tests/test_greedy_head.py`` checks random rows,
forced near ties, that the bound holds for every token of this machine's kernel, and that the screen
without the proof gets tokens wrong). The head's share of a step shrinks with the bytes it reads, most
for tree verifications, whose rows share one read of the screen.

Used for greedy verification (after the direct forward, or the model's own base model: see
``context.screened_head_serves``): sampling and drafters that read the
logits (SPECTRA) take the float32 head. CPU float32 targets whose head is a bias-free ``nn.Linear``
with a hidden size that is a multiple of 32 (the int8 kernel reads 16-value blocks).
"""

from __future__ import annotations

import time
from types import ModuleType

import torch
from torch import nn

from draftsmith.core.weight_copies import CopySource

_FP32_UNIT = 2.0**-24  # float32 unit roundoff
_FP64_UNIT = 2.0**-53
_BF16_UNIT = 2.0**-8  # bfloat16 keeps 8 significant bits
_SAFETY = 1.0 + 1e-6  # covers the rounding of the bound's own arithmetic
# per unit of |screen|: its bfloat16 output rounding, and float32 rounding of the bound and the comparisons
_OUTPUT_ROUNDING = _BF16_UNIT / (1.0 - _BF16_UNIT) + 8.0 * _FP32_UNIT
# The largest 16-bit screen input: 127 * 256 + 127, so that each one is two signed bytes (the AMX tiles' inputs);
# it binds below a width of 517 only (K * top * 127 < 2**31 keeps top lower from there on).
_SCREEN_TOP = 127 * 256 + 127
_CHUNK_ROWS = 4096  # weight rows per chunk when measuring the bf16 copy's error


def _gamma(terms: int, unit: float) -> float:
    """Higham's gamma_n: the relative error bound of a length-n dot product in any summation order."""
    return terms * unit / (1.0 - terms * unit)


class GreedyHead:
    """The exact greedy argmax of one float32 ``lm_head`` (see the module docstring)."""

    def __init__(self, head: nn.Linear, full_head_from: int | None = None) -> None:
        """``full_head_from``: see the module docstring (the kernel context times it per machine)."""
        start = time.perf_counter()
        self.source = CopySource(head.weight)
        self.head, self.full_head_from = head, full_head_from
        self.tiles_from: int | None = None  # rows from which AMX tiles sum the screen (the kernel context times it)
        weight = head.weight.detach()
        self.weight = weight
        self.scales, self.quantized = _int8_rows(weight)
        columns = weight.shape[1]
        self._gamma32 = _gamma(columns, _FP32_UNIT)
        self._gamma64 = _gamma(columns, _FP64_UNIT)
        # per token: the weight rounding's norm ||W_i - Q_i|| and max(||W_i||, ||Q_i||), rounded up
        row_bounds = torch.empty(2, weight.shape[0], dtype=torch.float32)
        for first in range(0, weight.shape[0], _CHUNK_ROWS):
            chunk = slice(first, first + _CHUNK_ROWS)
            exact = weight[chunk].double()
            screened = self.quantized[chunk].double() * self.scales[chunk].double()[:, None]
            norms = torch.maximum(exact.norm(dim=1), screened.norm(dim=1))
            row_bounds[0, chunk] = ((exact - screened).norm(dim=1) * _SAFETY).float()
            row_bounds[1, chunk] = (norms * _SAFETY).float()
        self._row_bounds = row_bounds
        self.fallback_rows = 0  # rows the proof could not settle (taken by the float32 head)
        self.rows = 0
        self.build_seconds = time.perf_counter() - start

    def screen_bounds(self, rows: torch.Tensor, screen_input: torch.Tensor, screen: torch.Tensor) -> torch.Tensor:
        """``D`` (``(R, V)``): ``|f_ri - a_ri| <= D_ri`` for every row r of ``rows`` (float32, ``(R, K)``)
        and token i, given the rows as the screen read them (:meth:`screen_rows`) and their screen ``a``
        (float32)."""
        bounds = self._coefficients(rows, screen_input) @ self._row_bounds
        return bounds.add_(screen.abs(), alpha=_OUTPUT_ROUNDING).mul_(_SAFETY)

    def _coefficients(self, rows: torch.Tensor, screen_input: torch.Tensor) -> torch.Tensor:
        """Per row, the factors of the two per-token norms in ``D`` (``(R, 2)``, float32, rounded up)."""
        exact = rows.double()
        rounded = screen_input.double()
        norm, rounded_norm = exact.norm(dim=1), rounded.norm(dim=1)
        weight_rounding = norm  # times ||W_i - Q_i||
        input_rounding = (exact - rounded).norm(dim=1)  # times max(||W_i||, ||Q_i||)
        # float32 accumulation of exact products (and a scale applied after the sum), in the screen
        # and in the float32 head itself; the integer screen's exact sum and its three float32 products
        # after it take far less of the first term
        accumulation = (self._gamma32 + _FP32_UNIT) * rounded_norm + self._gamma32 * norm
        return (torch.stack([weight_rounding, input_rounding + accumulation], dim=1) * _SAFETY).float()

    def move_to_huge_pages(self, native: ModuleType) -> None:
        """Keep the int8 copy in memory backed by huge pages (the extension's ``huge_page_empty``): every
        screen streams all of it, as a forward streams the stream kernel's packs."""
        self.quantized = native.huge_page_empty(list(self.quantized.shape), self.quantized.dtype).copy_(self.quantized)

    def __call__(self, x: torch.Tensor, native: ModuleType | None = None) -> torch.Tensor:
        """The float32 head's argmax for each row of ``x`` (``(..., hidden)``), as a long tensor of
        ``x.shape[:-1]``. ``native``: the runtime's C++ extension (:mod:`native`), which computes the
        screen, finds the contenders in two passes over the vocabulary and runs the proof."""
        return torch.tensor(self.token_list(x, native), dtype=torch.long).reshape(x.shape[:-1])

    def token_list(self, x: torch.Tensor, native: ModuleType | None = None) -> list[int]:
        """:meth:`__call__`'s tokens as a list, rows in order (what verification reads)."""
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        if self.full_head_from is not None and rows.shape[0] >= self.full_head_from:
            self.rows += rows.shape[0]
            return self.head(rows).argmax(dim=-1).tolist()
        if _int16_screen(native):
            proven = native.greedy_tokens(
                rows,
                self.quantized,
                self.scales,
                self._row_bounds,
                self.weight,
                self._gamma32,
                self._gamma64,
                _FP32_UNIT,
                _OUTPUT_ROUNDING,
                _SAFETY,
                tiles_from=self.tiles_from or 0,
            ).tolist()
            tokens = [token if token >= 0 else self._fallback(rows[r]) for r, token in enumerate(proven)]
        else:
            tokens = self._tokens(rows, native)
        self.rows += len(tokens)
        return tokens

    def _tokens(self, rows: torch.Tensor, native: ModuleType | None) -> list[int]:
        """Each row's token, step by step (the extension's ``greedy_tokens`` makes the same steps in one
        call where the 16-bit screen runs)."""
        floors, contenders = self.contenders(rows, native)
        finite = torch.isfinite(floors) & torch.isfinite(rows).all(dim=1)
        tokens = []
        for r, ok in enumerate(finite.tolist()):
            proven = self._proven_argmax(rows[r], contenders[r], native) if ok else None
            tokens.append(proven if proven is not None else self._fallback(rows[r]))
        return tokens

    def contenders(
        self, rows: torch.Tensor, native: ModuleType | None = None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Steps 1 and 2 for float32 ``rows`` (``(R, K)``): each row's floor and contenders (the part of
        a call whose cost does not depend on how many contenders the proof then checks)."""
        screen_input, screen = self.screen_rows(rows, native)
        return self._contenders(rows, screen_input, screen, native)

    def screen_rows(self, rows: torch.Tensor, native: ModuleType | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows as the screen reads them (``x'``: float64 for 16-bit integer rows, else bfloat16) and
        their screen ``a`` (``(R, V)``, bfloat16): 16-bit integer rows through the extension's exact
        integer product where it runs on this CPU, else :meth:`screen` of the bfloat16 rows."""
        if _int16_screen(native):
            integers, row_scales = _int16_rows(rows)
            tiles_from = self.tiles_from or 0
            screen = native.int16_screen(integers, row_scales, self.quantized, self.scales, tiles_from=tiles_from)
            return integers.double() * row_scales.double()[:, None], screen
        screen_input = rows.to(torch.bfloat16)
        return screen_input, self.screen(screen_input)

    @staticmethod
    def screen_integers(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Float32 ``rows`` as the 16-bit screen reads them: int16 rows and a float32 scale per row."""
        return _int16_rows(rows.contiguous())

    def screen(self, screen_input: torch.Tensor) -> torch.Tensor:
        """``a`` for bfloat16 rows (``(R, V)``, bfloat16) through torch's int8 product (the weights read once
        per row): exact products summed in float32 and scaled after the sum, as the bound assumes. Where the
        C++ extension runs, the 16-bit integer screen takes its place (:meth:`screen_rows`)."""
        return torch._weight_int8pack_mm(screen_input, self.quantized, self.scales)

    def _contenders(
        self, rows: torch.Tensor, screen_input: torch.Tensor, screen: torch.Tensor, native: ModuleType | None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Per row, the floor ``max_i (a_i - D_i)`` that some token's float32 logit reaches, and the
        tokens whose ceiling ``a_i + D_i`` reaches it (the others cannot be the argmax)."""
        if native is not None:
            coefficients = self._coefficients(rows, screen_input)
            return native.screen_contenders(screen, self._row_bounds, coefficients, _OUTPUT_ROUNDING, _SAFETY)
        screen = screen.float()
        bounds = self.screen_bounds(rows, screen_input, screen)
        floors = (screen - bounds).amax(dim=1)
        contenders = screen.add_(bounds) >= floors[:, None]
        return floors, [torch.nonzero(row).flatten() for row in contenders]

    def _proven_argmax(self, x: torch.Tensor, candidates: torch.Tensor, native: ModuleType | None) -> int | None:
        """The candidate whose float32 logit is provably the strict maximum, or None (through the C++
        extension where given: the same sums, without copying the candidates' weight rows)."""
        if native is not None:
            token = native.proven_argmax(x, self.weight, candidates, self._gamma32, self._gamma64, _SAFETY)
            return token if token >= 0 else None
        rows = self.weight.index_select(0, candidates).double()
        exact = x.double()
        logits = rows @ exact
        magnitude = rows.abs() @ exact.abs()
        # float32's error (any order) plus float64's own, with slack for the products' rounding
        error = (self._gamma32 + 2.0 * self._gamma64) * magnitude * _SAFETY + 1e-30
        best = int(logits.argmax())
        if candidates.numel() == 1:
            return int(candidates[0])
        rivals = torch.cat([logits[:best] + error[:best], logits[best + 1 :] + error[best + 1 :]])
        if float(logits[best] - error[best]) > float(rivals.max()):
            return int(candidates[best])
        return None

    def _fallback(self, x: torch.Tensor) -> int:
        self.fallback_rows += 1
        return int(self.head(x[None]).argmax())


def _int16_screen(native: ModuleType | None) -> bool:
    """Whether the extension's 16-bit integer screen (exact int32 sums: AVX2, AVX-512 VNNI or AMX) runs here."""
    return native is not None and native.int16_screen_available()  # true wherever the kernels run (AVX2, FMA)


def _int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row as int8 times a bfloat16 scale (``max |w| / 127``): the screen's weights."""
    scales = (weight.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.bfloat16).tiny).to(torch.bfloat16)
    quantized = torch.round(weight / scales.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return scales, quantized


def _int16_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each float32 row as int16 times a float32 scale (``max |x| / top``), with ``top`` small enough that
    no int32 sum of the screen can overflow (``K * top * 127 < 2**31``) and each value is two signed bytes
    (:data:`_SCREEN_TOP`): the 16-bit screen's input."""
    top = min(_SCREEN_TOP, (2**31 - 1) // (127 * rows.shape[1]))
    scales = (rows.abs().amax(dim=1) / top).clamp_min(torch.finfo(torch.float32).tiny)
    integers = torch.round(rows / scales[:, None]).clamp_(-top, top).to(torch.int16)
    return integers, scales


def greedy_head_supported(model: nn.Module) -> bool:
    """A float32 CPU target whose ``lm_head`` is a bias-free linear layer over a hidden size the int8
    kernel takes (a multiple of 32: it reads blocks of 16 values, and past the row on other sizes)."""
    head = getattr(model, "lm_head", None)
    return (
        hasattr(torch, "_weight_int8pack_mm")
        and isinstance(head, nn.Linear)
        and head.bias is None
        and head.weight.dtype == torch.float32
        and head.weight.device.type == "cpu"
        and head.weight.shape[1] % 32 == 0
    )
