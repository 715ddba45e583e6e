"""``--linear auto`` (the default): which one-pack kernel, ``stream`` or ``onednn``, runs the target's
linears on this machine, timed once and remembered (:func:`remembered` keeps the screened head's
hand-over row count the same way).

Which of the two reads the weights faster depends on the CPU (its vendor, vector width, caches and
memory) more than on the model, so the first run on a machine times both on the model's own weight
shapes and keeps the answer in a small JSON file beside the C++ build (torch's extensions folder,
one per torch release), keyed by the CPU's name, torch's release, the thread count, the shapes, what the
stream packs hold (4-bit codes read in a fraction of float32's time: the same shapes in float32, a
fine-tuned copy or a merged LoRA, may well time the other way) and the C++ kernels' source (a changed
kernel is timed again). One kernel serves every row count: choosing per row count would make a tree's
rows round differently from the plain steps they stand for, and verification would no longer compute
what plain decoding does.

The stream kernel's instruction set (AVX2, or AVX-512 where the CPU has it) is chosen the same way, once per
process and remembered per CPU model (:func:`choose_isa`): every path computes the same floats, so the choice
is speed alone, and it holds for every C++ kernel (attention and the screened head too). ``DRAFTSMITH_ISA``
(``avx2`` or ``avx512``) forces a path instead, as tests do to check each path a machine runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from draftsmith.core.devices import device_name
from draftsmith.core.io import atomic_write_json
from draftsmith.inference.kernels.native import build_directory, native_extension, source_digest

T = TypeVar("T")
CHOICES_FILE = "linear_kernel_choices.json"
# A plain decoding step, a small tree and a larger one, weighted alike: on Gemma-3's float32 packs AVX2 timed
# 5-8% faster at one row, tied at four and was 40% slower at eight, so timing one and four rows alone let
# noise pick it and made its 8-row forwards 29% slower.
TIMED_ROWS = (1, 4, 8)
_TIMED_ROWS_KEY = "/".join(map(str, TIMED_ROWS))  # in the remembered choices' keys: other rows, timed again
TIMED_BYTES = 96 << 20  # weights cycled through per timing: past the last-level cache, as in a forward
# A stream pack's outputs come in blocks of 16 (native.cpp's kStreamBlock): a weight's first 16 rows take
# the form its whole pack takes, unless only some of its rows are codes (a weight not met in practice).
SAMPLED_ROWS = 16
FORCED_ISA = "DRAFTSMITH_ISA"  # the environment variable that forces the C++ kernels' instruction set


def choose_isa(model: nn.Module, codes: bool = True, round_to_codes: bool = False) -> str | None:
    """The C++ kernels' instruction set for this process (None: they do not run on this CPU), set in the
    extension on the first call: :data:`FORCED_ISA` where set, the only one this CPU runs, or the faster of
    the stream kernel's paths on ``model``'s linears (packed as :func:`chosen_kernel` packs them), timed
    once per CPU model and remembered."""
    extension = native_extension()
    paths = tuple(extension.isas_available()) if extension is not None else ()
    if not paths:
        return None
    return _isa_set_once(model, paths, codes, round_to_codes)


def _isa_set_once(model: nn.Module, paths: tuple[str, ...], codes: bool, round_to_codes: bool) -> str:
    if _isa_state["chosen"] is None:
        forced = os.environ.get(FORCED_ISA, "").strip()
        if forced and forced not in paths:
            raise ValueError(f"{FORCED_ISA}={forced}: this CPU runs {', '.join(paths)}")
        use_isa(forced or (paths[0] if len(paths) == 1 else _timed_isa(model, paths, codes, round_to_codes)))
    return _isa_state["chosen"]


def use_isa(isa: str | None) -> None:
    """Every C++ kernel through ``isa`` (one of the extension's ``isas_available()``) from now on in this
    process, as if :func:`choose_isa` had chosen it; None: forget the choice (the next :func:`choose_isa`
    chooses again, the kernels take AVX-512 where the CPU has it until then)."""
    native_extension().set_isa(isa or "auto")
    _isa_state["chosen"] = isa


_isa_state: dict[str, str | None] = {"chosen": None}  # one choice per process: the extension's is process-wide


def _timed_isa(model: nn.Module, paths: tuple[str, ...], codes: bool, round_to_codes: bool) -> str:
    shapes = sorted({tuple(module.weight.shape) for module in model.modules() if isinstance(module, nn.Linear)})
    digest = hashlib.sha256(json.dumps(shapes).encode()).hexdigest()[:16]
    weights = _timed_weights(model)
    packing = {"codes": codes, "round_to_codes": round_to_codes and codes}

    def fastest() -> str:
        seconds = dict(zip(paths, _seconds(weights, ("stream",) * len(paths), isas=paths, **packing), strict=True))
        best = isa_from_timings(seconds)
        timings = ", ".join(f"{path} {1e3 * value:.1f} ms" for path, value in seconds.items())
        print(f"[kernels] stream kernel: timed {timings} on this CPU; using {best}", file=sys.stderr)
        return best

    what = (
        f"isa | {'/'.join(paths)} | shapes {digest} | stream packs {_stream_forms(weights, **packing)} "
        f"| narrower if {ISA_MARGIN:.0%} faster | rows {_TIMED_ROWS_KEY}"
    )
    return remembered(model, what, fastest, paths.__contains__)


# The instruction set is process-wide: the screened head (VNNI), the attention and the proof take it too,
# and run faster on the wider vectors on every CPU measured. A narrower path is chosen only where the
# stream kernel is clearly faster on it, not where timing noise splits a tie (memory-bound float32 packs).
ISA_MARGIN = 0.05


def isa_from_timings(seconds: dict[str, float]) -> str:
    """The instruction set to use given the stream kernel's seconds per path (narrowest first, as
    ``isas_available()`` lists them): the widest, unless a narrower one is faster by :data:`ISA_MARGIN`."""
    widest = list(seconds)[-1]
    best = min(seconds, key=seconds.__getitem__)
    return best if seconds[best] < (1.0 - ISA_MARGIN) * seconds[widest] else widest


def chosen_kernel(
    model: nn.Module, candidates: tuple[str, ...], codes: bool = True, round_to_codes: bool = False
) -> str:
    """The fastest of ``candidates`` (one-pack kernels that serve ``model``) on this machine: remembered
    where timed before, else timed now on ``model``'s linears (a second or two) and remembered. The
    stream packs timed are those ``PackedGemm(model, "stream", codes, round_to_codes)`` makes."""
    shapes = sorted({tuple(module.weight.shape) for module in model.modules() if isinstance(module, nn.Linear)})
    digest = hashlib.sha256(json.dumps(shapes).encode()).hexdigest()[:16]
    weights = _timed_weights(model)
    packing = {"codes": codes, "round_to_codes": round_to_codes and codes}

    def fastest() -> str:
        seconds = dict(zip(candidates, _seconds(weights, candidates, **packing), strict=True))
        best = min(seconds, key=seconds.__getitem__)
        timings = ", ".join(f"{kernel} {1e3 * value:.1f} ms" for kernel, value in seconds.items())
        where = choices_path()
        print(f"[kernels] linears: timed {timings} on this CPU; using {best} (remembered in {where})", file=sys.stderr)
        return best

    what = (
        f"linears | {'/'.join(candidates)} | shapes {digest} | stream packs {_stream_forms(weights, **packing)}"
        f" | rows {_TIMED_ROWS_KEY}"
    )
    return remembered(model, what, fastest, candidates.__contains__)


def _stream_forms(weights: list[torch.Tensor], codes: bool, round_to_codes: bool) -> str:
    """What the stream packs of ``weights`` hold, by form (``"exact 4-bit codes 210, float32 2"``), judged
    from each weight's first :data:`SAMPLED_ROWS` rows: packing them all would cost seconds."""
    from draftsmith.inference.kernels.packed_gemm import pack_form, stream_pack_made  # it imports this module

    forms: dict[str, int] = {}
    for weight in weights:
        blocks = weight.shape[0] % SAMPLED_ROWS == 0  # else no code layout takes the whole weight
        sample = weight[:SAMPLED_ROWS]
        form = pack_form(*stream_pack_made(sample, codes and blocks, round_to_codes and blocks))
        forms[form] = forms.get(form, 0) + 1
    return ", ".join(f"{form} {count}" for form, count in sorted(forms.items()))


def remembered(model: nn.Module, what: str, measure: Callable[[], T], valid: Callable[[Any], bool]) -> T:
    """A timed choice for ``model`` on this machine (``what`` names it and the shapes it depends on):
    read from the choices file where this machine, torch release, thread count and C++ source measured it
    before (and ``valid`` accepts it: the file may be edited by hand), else ``measure()``, remembered there."""
    device = device_name(next(model.parameters()).device)
    threads = torch.get_num_threads()
    key = f"{device} | torch {torch.__version__} | {threads} threads | native {source_digest()} | {what}"
    path = choices_path()
    choices = _read(path)
    if key in choices and valid(choices[key]):
        return choices[key]
    value = measure()
    try:
        atomic_write_json(path, {**choices, key: value})
    except OSError:
        pass  # a read-only folder: the next run measures again
    return value


def choices_path() -> Path:
    """Beside the runtime's C++ build, whose folder is per torch release."""
    return build_directory() / CHOICES_FILE


def _read(path: Path) -> dict[str, Any]:
    try:
        choices = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return choices if isinstance(choices, dict) else {}


def _timed_weights(model: nn.Module) -> list[torch.Tensor]:
    """The model's linear weights in order, up to :data:`TIMED_BYTES` (all of them in a small model)."""
    weights, total = [], 0
    for module in model.modules():
        if isinstance(module, nn.Linear) and total < TIMED_BYTES:
            weights.append(module.weight.detach())
            total += module.weight.numel() * module.weight.element_size()
    return weights


def _seconds(
    weights: list[torch.Tensor],
    kernels: tuple[str, ...],
    codes: bool,
    round_to_codes: bool,
    isas: tuple[str, ...] | None = None,
) -> list[float]:
    """Median seconds of every product of ``weights`` through each of ``kernels``' packs (the stream ones
    with ``codes`` and ``round_to_codes``; ``isas``: each kernel's instruction set, else the extension's
    choice), summed over :data:`TIMED_ROWS`; the kernels take turns, so a load that comes and goes weighs on
    each alike."""
    from draftsmith.inference.kernels.packed_gemm import one_pack, one_pack_product, stream_pack_made

    def pack(kernel: str, weight: torch.Tensor) -> torch.Tensor:
        return stream_pack_made(weight, codes, round_to_codes)[0] if kernel == "stream" else one_pack(kernel, weight)

    packs = {kernel: [pack(kernel, weight) for weight in weights] for kernel in set(kernels)}
    paths = isas or ("auto",) * len(kernels)
    totals = [0.0] * len(kernels)
    generator = torch.Generator().manual_seed(0)  # not torch's default one, which a user may have seeded
    with torch.no_grad():
        for rows in TIMED_ROWS:
            inputs = {weight.shape[1]: torch.randn(rows, weight.shape[1], generator=generator) for weight in weights}

            def products(kernel: str, isa: str) -> Callable[[], None]:
                def run() -> None:
                    for weight, pack in zip(weights, packs[kernel], strict=True):
                        one_pack_product(kernel, inputs[weight.shape[1]], pack, isa)

                return run

            seconds = side_by_side_seconds([products(kernel, isa) for kernel, isa in zip(kernels, paths, strict=True)])
            totals = [total + value for total, value in zip(totals, seconds, strict=True)]
    return totals


def side_by_side_seconds(
    runs: list[Callable[[], object]], repeats: int = 7, before: Callable[[], object] | None = None
) -> list[float]:
    """The median seconds of each of ``runs``, timed in turns (each once per round, after an untimed
    round): on a shared machine whose speed drifts, medians taken one after the other would compare the
    drift as much as the runs. ``before``, where given, runs untimed before every timed run (to leave the
    caches as the runs find them in real use)."""
    for run in runs:
        run()
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(repeats):
        for run, taken in zip(runs, times, strict=True):
            if before is not None:
                before()
            start = time.perf_counter()
            run()
            taken.append(time.perf_counter() - start)
    return [statistics.median(taken) for taken in times]
