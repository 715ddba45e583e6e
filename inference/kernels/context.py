"""One model's eager fast paths, made once and held by the verification backend that uses them: the
packed GEMM's packs, the direct forward (with the C++ layers where they serve) and the screened greedy
head. Each is made on first use and its build time recorded, so the runtime keeps it out of speed
figures; a caller that decodes many prompts keeps one context per model and pays each build once."""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from types import ModuleType
from typing import Any, TypeVar

import torch
from torch import nn
from transformers import PreTrainedModel

from draftsmith.inference.kernels.attention import model_attention, rows_attention_available, sdpa_from_rows
from draftsmith.inference.kernels.direct import (
    DIRECT_FORWARDS,
    AnyDirectForward,
    direct_forward_architecture,
    direct_forward_for,
    direct_forward_supported,
    has_foreign_hooks,
)
from draftsmith.inference.kernels.greedy_head import GreedyHead, greedy_head_supported
from draftsmith.inference.kernels.linear_choice import remembered, side_by_side_seconds
from draftsmith.inference.kernels.native import native_extension
from draftsmith.inference.kernels.options import KernelOptions
from draftsmith.inference.kernels.packed_gemm import ONE_PACK_KERNELS, PackedGemm, linear_kernel_for

T = TypeVar("T")
# a prompt of this many tokens or more is prefilled by the library's kernels (model_forwards): on the Intel
# VM of docs/benchmarks.md they beat the stream kernel and the row-by-row attention from ~300 rows on with
# float32 packs, from ~200 with 4-bit codes (whose rows cost more multiply-adds' time than reading)
LIBRARY_PROMPT_ROWS = 256
FULL_HEAD_CANDIDATES = (2, 4, 8, 16, 32)  # verification row counts at which the screen and the full head are timed
TILES_CANDIDATES = (1, 2, 3, 4, 5, 6, 8, 12, 16)  # row counts at which the screen's VNNI and AMX sums are timed


class KernelContext:
    """The fast paths ``options`` allow for ``model`` (see the module docstring). ``setup_seconds``:
    time spent building them so far (packing included)."""

    def __init__(self, model: nn.Module, options: KernelOptions) -> None:
        self.model, self.options = model, options
        # what the options ask, where it serves
        self.linear = linear_kernel_for(model, options.linear, options.native, options.weight_codes)
        self.gemm = PackedGemm(model, self.linear, options.weight_codes) if self.linear != "default" else None
        self.rows_attention = rows_attention_available(model, options.native)  # attention.py
        self._direct: AnyDirectForward | None = None
        self._head: GreedyHead | None = None
        self._built_seconds = 0.0

    @property
    def setup_seconds(self) -> float:
        return self._built_seconds + self._packing_seconds()

    def model_forwards(self) -> AbstractContextManager[None]:
        """The context for the model's own forwards (the prompt's prefill, a reference ``generate``) that
        keeps them the runtime's numerical model: the linears' one-pack kernel
        (:meth:`PackedGemm.model_forwards`) and the row-invariant attention where the runtime uses them.

        A forward of :data:`LIBRARY_PROMPT_ROWS` rows or more runs the library's large-matrix kernels
        instead (MKL's GEMM, SDPA; the output head keeps its pack): row invariance is what lets a tree's
        rows stand for plain steps, and no later forward computes a prompt's rows again. Here the only
        such forward is a prompt's: the runtime's prefill and the reference's first forward run the same
        prompt through this same context, so both still compute the same floats."""
        stack = ExitStack()
        if self.gemm is not None:
            stack.enter_context(self.gemm.model_forwards())
            stack.enter_context(self.gemm.library_from_rows(LIBRARY_PROMPT_ROWS))
        stack.enter_context(self.attention())
        if self.rows_attention:
            stack.enter_context(sdpa_from_rows(LIBRARY_PROMPT_ROWS))
        return stack

    def attention(self) -> AbstractContextManager[None]:
        """The context in which the model's own forwards attend as the runtime's do (:mod:`attention`)."""
        return model_attention(self.model) if self.rows_attention else nullcontext()

    def direct(self) -> AnyDirectForward | None:
        """The direct forward, or None where the model's own forward must run (not a supported Llama or
        Gemma-3, in training mode, or carrying hooks: checked on every call, since a user may change that)."""
        if not self.options.direct_forward:
            return None
        if not direct_forward_architecture(self.model):
            say_own_forward(self.model)
            return None
        if not direct_forward_supported(self.model):
            return None
        if self._direct is None:  # its first build loads (or compiles) the C++ extension
            self._direct = self._timed(lambda: direct_forward_for(self.model, self.options.native))
        return self._direct

    def greedy_head(self) -> GreedyHead | None:
        """The screened head for greedy verification, after the direct forward or, where none serves, the
        model's own base model (:func:`screened_head_serves`); remade whenever the head's weight was
        replaced or changed in place (a stale screen could miss the argmax)."""
        if not self.options.greedy_head or not greedy_head_supported(self.model):
            return None
        if self.direct() is None and not screened_head_serves(self.model):
            return None
        if self._head is None or not self._head.source.still(self.model.lm_head.weight):
            self._head = self._timed(self._screened_head)
        return self._head

    def extension(self) -> ModuleType | None:
        """The runtime's C++ extension where the options allow it (the direct forward's, if one serves)."""
        direct = self.direct()
        if direct is not None:
            return direct.extension
        return native_extension() if self.options.native else None

    def _screened_head(self) -> GreedyHead:
        head, extension = GreedyHead(self.model.lm_head), self.extension()
        if extension is not None:
            head.move_to_huge_pages(extension)
        head.full_head_from = self._full_head_from(head)
        head.tiles_from = self._tiles_from(head)
        return head

    def _full_head_from(self, screened: GreedyHead) -> int | None:
        """The row count from which the float32 head through a row-invariant one-pack kernel beats the
        screen's int8 product and contender search (through the direct forward's extension) on this
        machine, timed once per machine, torch release, thread count and head shape and remembered beside
        the C++ build (:func:`remembered`); None where the kernel is not row-invariant or the screen always
        wins. The screen's proof is not timed: on real text it checks a few contenders a row. The rows
        are the model's own last hidden states (random inputs give flat logits, whose many contenders
        would make the screen look slower than it is on text). Before each timed head a one-token forward
        streams the decoder's weights, so that the caches hold what they hold after a verification's
        layers (with the head warm in the cache the screen's arithmetic looks dearer than it is)."""
        if self.gemm is None or not self.gemm.row_invariant():
            return None
        shape = "x".join(str(size) for size in self.model.lm_head.weight.shape)
        what = f"full head from | {self.gemm.kernel} linears | head {shape} | rows {FULL_HEAD_CANDIDATES}"
        measure = functools.partial(self._time_full_head_from, screened)
        return remembered(self.model, what, measure, lambda rows: rows in (None, *FULL_HEAD_CANDIDATES))

    def _time_full_head_from(self, screened: GreedyHead) -> int | None:
        head, native = self.model.lm_head, self.extension()

        def screen_and_full(x: torch.Tensor) -> list[Callable[[], object]]:
            return [lambda: screened.contenders(x, native), lambda: head(x).argmax(dim=-1)]

        return self._rows_from_which_second_wins(FULL_HEAD_CANDIDATES, screen_and_full)

    def _rows_from_which_second_wins(
        self, candidates: tuple[int, ...], runs: Callable[[torch.Tensor], list[Callable[[], object]]]
    ) -> int | None:
        """The fewest of ``candidates`` rows from which the second of ``runs(x)`` beats the first at that count
        and every larger one (None: at none), ``x`` that many of the model's own last hidden states; the two
        timed side by side, each after a one-token forward that streams the decoder's weights, so that the
        caches hold what they hold after a verification's layers."""
        states = self._sample_states(max(candidates))
        token = torch.zeros(1, 1, dtype=torch.long, device=states.device)
        faster = []
        with torch.no_grad(), self.gemm.rows() if self.gemm is not None else nullcontext():

            def stream_the_layers() -> None:
                self.model.model(input_ids=token, use_cache=False)

            for rows in candidates:
                first, second = side_by_side_seconds(
                    runs(states[:rows].contiguous()), repeats=5, before=stream_the_layers
                )
                faster.append(second < first)
        return next((rows for i, rows in enumerate(candidates) if all(faster[i:])), None)

    def _tiles_from(self, screened: GreedyHead) -> int | None:
        """The row count from which the screen's integer sums run faster on AMX tiles than with VNNI (the
        same integers either way) on this machine, timed once per machine, torch release, thread count and
        head shape and remembered as :meth:`_full_head_from` is; None where the CPU has no tiles or no VNNI, the
        process's kernels took AVX2, or VNNI is never slower. Each timed screen follows a one-token forward, as in
        verification (with the int8 copy warm in the cache the tiles' faster arithmetic looks worth more)."""
        native = self.extension()
        if native is None or not native.amx_available() or not native.vnni_available():
            return None
        if native.isa_in_use() != "avx512":  # the process took AVX2 (timed or forced): no tiles follow from it
            return None
        shape = "x".join(str(size) for size in self.model.lm_head.weight.shape)
        what = f"screen tiles from | head {shape} | rows {TILES_CANDIDATES}"
        measure = functools.partial(self._time_tiles_from, screened, native)
        return remembered(self.model, what, measure, lambda rows: rows in (None, *TILES_CANDIDATES))

    def _time_tiles_from(self, screened: GreedyHead, native: ModuleType) -> int | None:
        def vnni_and_tiles(x: torch.Tensor) -> list[Callable[[], object]]:
            integers, scales = screened.screen_integers(x)
            screen = functools.partial(native.int16_screen, integers, scales, screened.quantized, screened.scales)
            return [functools.partial(screen, isa=isa) for isa in ("avx512", "amx")]

        return self._rows_from_which_second_wins(TILES_CANDIDATES, vnni_and_tiles)

    @torch.no_grad()
    def _sample_states(self, rows: int) -> torch.Tensor:
        """``rows`` last hidden states (the head's inputs) of the model over a fixed token sequence."""
        vocabulary = self.model.config.vocab_size
        tokens = (torch.arange(rows) * 7919 + 101) % vocabulary
        device = next(self.model.parameters()).device
        return self.model.model(input_ids=tokens[None].to(device)).last_hidden_state[0]

    def linear_record(self) -> dict[str, Any]:
        """Which kernel ran the target's linears, as ``bench`` and ``bench-tree`` record it: a one-pack
        kernel, the stream kernel or oneDNN's (every forward; whether its rows are bitwise row-invariant
        on this machine, from how many rows greedy verification took the float32 head and the screen summed
        on AMX tiles), MKL's packed GEMM (its row buckets) or PyTorch's default; and the seconds spent
        packing (kept out of every speed figure)."""
        gemm = self.gemm
        if gemm is None:
            return {"kernel": "default"}
        record: dict[str, Any] = {"kernel": gemm.kernel, "pack_seconds": round(gemm.pack_seconds, 1)}
        if gemm.kernel == "stream":
            record["isa"] = native_extension().isa_in_use()
        if gemm.kernel in ONE_PACK_KERNELS:
            invariant = {
                "row_invariant": gemm.row_invariant(),
                "full_head_from": self.full_head_from,
                "screen_tiles_from": self._head.tiles_from if self._head is not None else None,
            }
            return {**record, **invariant, "pack_forms": gemm.pack_forms()}
        return {**record, "buckets": gemm.buckets}

    @property
    def full_head_from(self) -> int | None:
        """Where the screened head hands over to the float32 head (None: never, or not built yet)."""
        return self._head.full_head_from if self._head is not None else None

    def _timed(self, build: Callable[[], T]) -> T:
        """``build()``, its seconds added to the setup time but for any packing inside it, which the
        gemm's ``pack_seconds`` counts already (counted twice, setup outgrew the wall clock)."""
        packed_before = self._packing_seconds()
        start = time.perf_counter()
        made = build()
        self._built_seconds += time.perf_counter() - start - (self._packing_seconds() - packed_before)
        return made

    def _packing_seconds(self) -> float:
        return self.gemm.pack_seconds if self.gemm is not None else 0.0


# Model types whose causal-LM forward is exactly ``lm_head`` over the base model's last state (with an
# optional final softcapping, which the check below refuses): the screened head can stand in for it.
HEAD_OVER_BASE_MODEL_TYPES = ("llama", "gemma3_text", "qwen2", "qwen3", "mistral")


def screened_head_serves(model: nn.Module) -> bool:
    """Whether greedy verification through the model's own forward may run its base model and take the
    screened head instead of its logits: a model type whose logits are the head over the base model's last
    state, no final logit softcapping, in inference mode, and no hooks the skipped outer forward would run."""
    config = getattr(model, "config", None)
    return (
        getattr(config, "model_type", None) in HEAD_OVER_BASE_MODEL_TYPES
        and getattr(config, "final_logit_softcapping", None) is None
        and isinstance(model, PreTrainedModel)  # not a wrapper (a PEFT model) whose ``model`` is not the base
        and not model.training
        and not any(has_foreign_hooks(module) for module in model.modules())
    )


def say_own_forward(model: nn.Module) -> None:
    """One line per process and architecture where the fast paths cannot serve a target, so a slower
    decode of a new architecture is explained rather than silent. A wrapper around a served architecture
    (a PEFT model around a Llama) is not another architecture and says nothing."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in _SERVED_MODEL_TYPES:
        _say_once(type(model).__name__)


_SERVED_MODEL_TYPES = {architecture.config_class.model_type for architecture in DIRECT_FORWARDS}


@functools.cache
def _say_once(architecture: str) -> None:
    print(
        "[runtime] the direct forward serves Llama and Gemma-3 only (the C++ decoder layers Llama only): "
        f"{architecture} decodes through its own forward (the same tokens, a slower step)",
        file=sys.stderr,
    )
