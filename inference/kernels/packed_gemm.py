"""Weights-once linears for the runtime's forwards: a forward over a few rows should cost about what one
row costs, since on a CPU the weights are read once either way.

PyTorch's default fp32 ``linear`` (MKL ``sgemm``) falls well short of that for small row counts and, on
some CPUs, of the memory's read speed even for one row. Three prepacked kernels do better; ``draftsmith
bench-tree --linear ...`` measures each on a machine:

- ``stream``: the runtime's own C++ kernel (:mod:`native`, x86-64 CPUs with AVX2 and FMA): each weight
  copied once into blocks of 16 outputs stored input by input, which a forward reads front to back once
  for up to 6 rows per pass, asking the L2 cache for the next block while it computes. Every output is
  summed input by input in one fixed order whatever the row count, so it is row-invariant by
  construction; one pack serves every row count, as oneDNN's.
- ``onednn``: oneDNN's prepacked linear (``torch.ops.mkldnn._reorder_linear_weight`` once, then
  ``_linear_pointwise``; what inductor's ``freezing`` uses on a CPU). One pack per weight serves every
  row count, one row included, so plain decoding steps, tree verifications and the prompt's prefill
  all run through it. Its rounding must not depend on the row count, or a tree's rows would differ from
  the plain steps they stand for: :meth:`PackedGemm.row_invariant` checks that on the machine, and
  ``bench`` reports it.
- ``mkl``: MKL's packed GEMM (``cblas_sgemm_pack`` / ``compute``, ``torch.ops.mkl._mkl_linear``). A pack
  is made for one row count, so a verification forward's rows are padded up to a **row bucket** (2, 4,
  8, 16, 32): padding rows repeat the root token, attend only to committed tokens and themselves, and
  no real row attends to them, so they change no real row's output; their keys land past the rows the
  commit keeps. One-row forwards and larger trees use the default kernel.

Each kind copies every linear weight (about the model's size: 0.5 GB for SmolLM2 in fp32; ``mkl``
once per bucket). Packs are made when first needed, never past half of the memory then available.

With ``stream`` or ``onednn`` the runtime's numerical model is the target with that kernel's linears: the
reference that ``bench`` checks every method against (HF ``generate``) runs through the same packs
(:meth:`PackedGemm.model_forwards`). MKL's packed rows round differently from the default kernel's by
float32 noise, as the default kernel's own rounding already differs between one and several rows.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.core.weight_copies import CopySource
from draftsmith.inference.kernels import LINEAR_KERNELS
from draftsmith.inference.kernels.linear_choice import choose_isa, chosen_kernel
from draftsmith.inference.kernels.native import native_extension

ROW_BUCKETS = (2, 4, 8, 16, 32)
MEMORY_SHARE = 0.5  # a bucket is packed only if its packs fit in this share of the available memory
ANY_ROWS = 0  # the pack key of a kernel whose one pack serves every row count (stream, oneDNN)
ONE_PACK_KERNELS = ("stream", "onednn")
PACK_KINDS = {"mkl": 0, "onednn": 1, "stream": 2}  # native.cpp's PackKind codes
# what a stream pack holds, by its dtype (native.cpp's stream_pack): every form computes the same floats
CODE_FORMS = ("exact 4-bit codes", "exact 8-bit codes")
ROUNDED_FORM = "4-bit codes of weights rounded to blocks"  # a drafter's packs (PackedGemm's round_to_codes)
PACK_FORMS = {
    torch.uint8: CODE_FORMS[0],
    torch.int8: CODE_FORMS[1],
    torch.bfloat16: "exact bfloat16",
    torch.float32: "float32",
}
CODE_DTYPES = tuple(dtype for dtype, form in PACK_FORMS.items() if form in CODE_FORMS)


def one_pack(kernel: str, weight: torch.Tensor, codes: bool = True) -> torch.Tensor:
    """``weight`` packed for a one-pack kernel (:data:`ONE_PACK_KERNELS`); ``codes``: the stream kernel's
    pack holds 4- or 8-bit codes where they rebuild every weight bit for bit."""
    if kernel == "stream":
        return native_extension().stream_pack(weight, codes=codes)
    return torch.ops.mkldnn._reorder_linear_weight(weight)  # no row hint: the pack is row-invariant


def stream_pack_made(
    weight: torch.Tensor, codes: bool = True, round_to_codes: bool = False
) -> tuple[torch.Tensor, bool]:
    """The stream kernel's pack of ``weight`` as :class:`PackedGemm` makes it, and whether it holds the
    weights rounded: with ``round_to_codes`` (a drafter's packs), the 4-bit codes of its weights rounded to
    blocks where they are no such codes themselves and the code layout takes their shape."""
    pack = one_pack("stream", weight, codes)
    if round_to_codes and pack.dtype not in CODE_DTYPES and weight.shape[1] % 32 == 0:
        rounded = one_pack("stream", rounded_to_four_bit_blocks(weight), codes=True)
        if rounded.dtype in CODE_DTYPES:  # else (a height the code layout does not take) the exact pack
            return rounded, True
    return pack, False


def pack_form(pack: torch.Tensor, rounded: bool) -> str:
    """What a one-pack kernel's pack holds (:data:`PACK_FORMS`, :data:`ROUNDED_FORM`)."""
    return ROUNDED_FORM if rounded else PACK_FORMS.get(pack.dtype, "a library's layout")


def rounded_to_four_bit_blocks(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (out, in; in a multiple of 32) rounded as GGUF's Q4_1 rounds it, in float32: per 32 inputs
    of an output, the nearest of 16 evenly spaced values from the least to the greatest, the step and the
    least held as float16 (so the stream pack rebuilds every value from its code, bit for bit)."""
    blocks = weight.float().reshape(weight.shape[0], -1, 32)
    least, greatest = blocks.aminmax(dim=-1, keepdim=True)
    step = (greatest - least) / 15
    safe = torch.where(step > 0, step, torch.ones_like(step))
    codes = ((blocks - least) / safe + 0.5).floor().clamp(0, 15).where(step > 0, torch.zeros_like(blocks))
    return (step.half().float() * codes + least.half().float()).reshape(weight.shape)


def one_pack_product(kernel: str, rows: torch.Tensor, pack: torch.Tensor, isa: str = "auto") -> torch.Tensor:
    """A one-pack kernel's bias-free product of ``rows`` with a weight packed by :func:`one_pack` (the stream
    kernel's through the instruction set ``isa``, ``auto``: the process's choice)."""
    if kernel == "stream":
        return native_extension().stream_linear(rows, pack, isa=isa)
    return torch.ops.mkldnn._linear_pointwise(rows, pack, None, "none", [], "")


def linear_kernel_available(kernel: str, native: bool = True) -> bool:
    """Whether this PyTorch build has ``kernel`` (``stream``: the C++ extension, where ``native`` allows
    it, built on a CPU it runs on)."""
    if kernel == "stream":
        extension = native_extension() if native else None
        return extension is not None and extension.simd_supported()
    if kernel == "onednn":
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    if kernel == "mkl":
        return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")
    return kernel == "default"


def linear_kernel_for(
    model: nn.Module, asked: str, native: bool = True, codes: bool = True, round_to_codes: bool = False
) -> str:
    """The kernel ``model``'s linears run with when ``asked`` is wanted: a prepacked one needs float32
    weights on the CPU and a build that has it (``stream`` also ``native``); otherwise the next one in
    :data:`LINEAR_KERNELS`. ``auto``: the faster one-pack kernel on this machine where both serve
    (:mod:`linear_choice`), timed with the stream packs :class:`PackedGemm` would make (``codes``,
    ``round_to_codes``) through the stream kernel's instruction set, chosen first (:func:`choose_isa`)."""
    if asked not in LINEAR_KERNELS:
        raise ValueError(f"unknown linear kernel {asked!r}; choose one of {', '.join(LINEAR_KERNELS)}")
    parameter = next(model.parameters(), None)
    if parameter is None or parameter.device.type != "cpu" or parameter.dtype != torch.float32:
        return "default"
    candidates = LINEAR_KERNELS[LINEAR_KERNELS.index(asked) :]
    served = [kernel for kernel in candidates if kernel != "auto" and linear_kernel_available(kernel, native)]
    one_pack_kernels = tuple(kernel for kernel in served if kernel in ONE_PACK_KERNELS)
    if native and linear_kernel_available("stream", native):
        choose_isa(model, codes, round_to_codes)
    if asked == "auto" and len(one_pack_kernels) > 1:
        return chosen_kernel(model, one_pack_kernels, codes, round_to_codes)
    return served[0]


def packed_gemm_supported(model: nn.Module) -> bool:
    """Float32 weights on the CPU, with a prepacked kernel in this PyTorch build."""
    return linear_kernel_for(model, "onednn") != "default"


def row_bucket(rows: int) -> int | None:
    """The padded row count of a ``rows``-row forward, or None when it runs unpadded and unpacked."""
    if rows < 2:
        return None
    return next((bucket for bucket in ROW_BUCKETS if rows <= bucket), None)


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` (same parameters, same state dict) that, while its owner's packs are active and
    gradients are off, multiplies through the pack made for the input's row count."""

    _packs: dict[int, torch.Tensor]
    _owner: PackedGemm
    _packed_from: CopySource  # the weight its packs were made from

    def active_pack(self, rows: int) -> torch.Tensor | None:
        """The pack a ``rows``-row input multiplies through now, if any."""
        if not self._owner.active or torch.is_grad_enabled():
            return None
        return self._packs.get(self._owner.pack_key(rows))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        pack = self.active_pack(rows)
        if pack is None or self._owner.library_serves(self, rows):
            return F.linear(x, self.weight, self.bias)
        if self._owner.kernel == "stream":
            out = one_pack_product("stream", x, pack)
            return out if self.bias is None else out + self.bias
        if self._owner.kernel == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, pack, self.bias, "none", [], "")
        out = torch.ops.mkl._mkl_linear(x.reshape(rows, x.shape[-1]), pack, self.weight, self.bias, rows)
        return out.reshape(*x.shape[:-1], out.shape[-1])


def _owned_by(linear: nn.Module, gemm: PackedGemm) -> bool:
    return isinstance(linear, PackedLinear) and linear._owner is gemm


def active_pack(linear: nn.Module, rows: int) -> torch.Tensor | None:
    """The pack ``linear`` multiplies a ``rows``-row input through now (None: the default kernel)."""
    return linear.active_pack(rows) if isinstance(linear, PackedLinear) else None


def stream_pack_bytes(model: nn.Module) -> dict[int, int]:
    """The bytes of each stream pack a one-row forward of ``model`` reads instead of its linear's weight,
    by the weight's address (a pack of codes or bfloat16 holds fewer bytes than the weight)."""
    found = {}
    for module in model.modules():
        if isinstance(module, PackedLinear) and module._owner.kernel == "stream":
            pack = module._packs.get(ANY_ROWS)
            if pack is not None:
                found[module.weight.data_ptr()] = pack.numel() * pack.element_size()
    return found


def pack_kind(linear: nn.Module) -> int:
    """The C++ layers' code (:data:`PACK_KINDS`) for the kernel of ``linear``'s packs (MKL's where it has
    none: it is then not packed, and the code is not read)."""
    return PACK_KINDS[linear._owner.kernel] if isinstance(linear, PackedLinear) else PACK_KINDS["mkl"]


class PackedGemm:
    """The packs of one target model for ``kernel`` (``stream``, ``onednn`` or ``mkl``, see the module docstring),
    held by its kernel context (:mod:`kernels.context`). It turns the model's ``nn.Linear`` modules into
    :class:`PackedLinear`, which behave exactly as before outside :meth:`rows`' context; a later
    ``PackedGemm`` of the same modules takes them over, with no packs yet, and this one takes them back
    (packing them again) when it is used next (:meth:`_reclaim`)."""

    takeovers = 0  # linears taken from another PackedGemm so far, process-wide: a gemm rescans when it changes
    # times any PackedGemm took linears (new ones or another's), process-wide: while it stays, every linear
    # has the owner it had (what native_layers' pack inputs read per forward)
    ownership_changes = 0

    def __init__(self, model: nn.Module, kernel: str = "mkl", codes: bool = True, round_to_codes: bool = False) -> None:
        """``codes``: stream packs hold 4- or 8-bit codes where they rebuild every weight of a projection.
        ``round_to_codes`` (a drafter's packs, never a target's): a projection whose weights are no such
        codes is packed as the 4-bit codes of its weights rounded to blocks (:func:`rounded_to_four_bit_blocks`),
        a third of the bytes of a bfloat16 pack; its products then differ from the module's own."""
        if kernel not in PACK_KINDS:
            raise ValueError(f"PackedGemm packs for 'stream', 'onednn' or 'mkl', not {kernel!r}")
        self.kernel = kernel
        self.codes = codes
        self.round_to_codes = round_to_codes and codes and kernel == "stream"
        self._rounded: set[int] = set()  # the linears (by id) whose packs hold rounded weights
        self.active = False
        self.library_from: int | None = None  # input rows from which the default kernel serves (library_from_rows)
        # the output head always multiplies through its pack: a prompt's last row is the first token's logits,
        # and how many rows reach the head (all, or the last alone) differs between callers
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        self._head = head if isinstance(head, nn.Linear) else None
        self._linears: list[PackedLinear] = []
        PackedGemm.ownership_changes += 1
        for module in model.modules():
            if type(module) in (nn.Linear, PackedLinear):
                PackedGemm.takeovers += type(module) is PackedLinear
                module.__class__ = PackedLinear
                module._packs, module._owner = {}, self
                self._linears.append(module)
        self._made: set[int] = set()  # the pack keys made so far, made again for linears taken back
        self._takeovers_seen = PackedGemm.takeovers
        self._bytes_per_bucket = sum(m.weight.numel() * m.weight.element_size() for m in self._linears)
        self._refused: set[int] = set()
        self.pack_seconds = 0.0  # time spent packing so far: callers keep it out of speed figures
        # stacked packs of sibling linears (fused_pack), by the modules, with the packs they were made from
        self._fused: dict[tuple[int, ...], tuple[tuple[torch.Tensor, ...], torch.Tensor]] = {}
        self._fusion_exact: bool | None = None  # whether stacking keeps each column bitwise (checked once)
        self.generation = 0  # counts changes to the packs: what was read from them is current while it stays

    @property
    def buckets(self) -> list[int]:
        """The row counts packed so far (``[0]``: one pack for every row count, :data:`ANY_ROWS`)."""
        return sorted(self._linears[0]._packs) if self._linears else []

    def pack_key(self, rows: int) -> int:
        """The key of the pack a ``rows``-row input uses."""
        return ANY_ROWS if self.kernel in ONE_PACK_KERNELS else rows

    def padded_rows(self, rows: int, checked: bool = False) -> int:
        """How many rows a ``rows``-row verification forward should run with, its packs made: a MKL
        bucket when that bucket is (or can be) packed, else ``rows`` itself. ``checked``: the packs were
        made fresh earlier in the same generation (its prefill, through :meth:`model_forwards`), so a
        one-pack kernel's pack serves as it is, without looking at every weight again."""
        if not self._linears:
            return rows
        self._reclaim()
        if self.kernel in ONE_PACK_KERNELS:
            if not (checked and ANY_ROWS in self._linears[0]._packs):
                self._drop_stale_packs()
                self._ensure(ANY_ROWS)
            return rows
        bucket = row_bucket(rows)
        if bucket is None:
            return rows
        self._drop_stale_packs()
        return bucket if self._ensure(bucket) else rows

    def model_forwards(self) -> AbstractContextManager[None]:
        """The context for the model's own forwards (the prompt's prefill, a reference ``generate``) that
        keeps them the runtime's numerical model: the stream kernel's or oneDNN's pack, which every runtime
        forward uses, serves them too; MKL's buckets serve verification forwards alone."""
        if self.kernel not in ONE_PACK_KERNELS or not self._linears:
            return nullcontext()
        self.padded_rows(1)
        return self.rows()

    def row_invariant(self) -> bool:
        """Whether a row's product is bitwise the same alone and among others (up to 32) on this machine:
        what makes a tree verification compute exactly what plain steps compute. Checked on the first
        linear's pack with random rows (MKL's buckets: only within one bucket, so False)."""
        if self.kernel not in ONE_PACK_KERNELS or not self._linears:
            return False
        self.padded_rows(1)
        linear = self._linears[0]
        rows = torch.randn(32, linear.in_features, generator=torch.Generator().manual_seed(0))
        with torch.no_grad(), self.rows():
            together = linear(rows)
            alone = torch.cat([linear(rows[i : i + 1]) for i in range(rows.shape[0])])
        return torch.equal(together, alone)

    def fused_pack(self, linears: tuple[nn.Module, ...]) -> torch.Tensor | None:
        """One pack of ``linears``' weights stacked (e.g. q, k and v, which read the same input),
        for while their own packs are active: one product instead of several, whose output columns are
        bitwise theirs. None where that does not hold: another kernel, a module without an active pack,
        a machine where stacking changes a column's rounding, or too little memory for the copy."""
        if self.kernel not in ONE_PACK_KERNELS or not self.active or torch.is_grad_enabled():
            return None
        packs = tuple(linear._packs.get(ANY_ROWS) if _owned_by(linear, self) else None for linear in linears)
        if any(pack is None for pack in packs) or any(linear.bias is not None for linear in linears):
            return None
        rounded = {id(linear) in self._rounded for linear in linears}
        if len(rounded) > 1:  # one stacked pack holds its weights in one way
            return None
        key = tuple(id(linear) for linear in linears)
        made = self._fused.get(key)
        if made is not None and all(a is b for a, b in zip(made[0], packs, strict=True)):
            return made[1]
        if self._fusion_exact is False:
            return None
        stacked = torch.cat([linear.weight.detach() for linear in linears])
        if stacked.numel() * stacked.element_size() > MEMORY_SHARE * _available_bytes():
            return None
        start = time.perf_counter()
        members_rounded = rounded.pop()
        fused, fused_rounded = self._pack(stacked, ANY_ROWS, may_round=members_rounded)
        self.pack_seconds += time.perf_counter() - start
        if fused_rounded != members_rounded:
            return None
        if self._fusion_exact is None:  # checked once, on the first stacked pack
            self._fusion_exact = self._same_columns(fused, packs, stacked.shape[1])
            if not self._fusion_exact:
                return None
        self._fused[key] = (packs, fused)
        self.generation += 1
        return fused

    def _drop_stale_packs(self) -> None:
        """A pack is a copy: after a weight is replaced or changed in place (an optimizer step,
        ``load_state_dict``) its packs would multiply by the old values, so they go."""
        for module in self._linears:
            if module._packs and not module._packed_from.still(module._parameters["weight"]):
                module._packs.clear()
                self.generation += 1

    def library_serves(self, linear: nn.Module, rows: int) -> bool:
        """Whether a ``rows``-row input of ``linear`` goes to the default kernel though it has a pack."""
        return self.library_from is not None and rows >= self.library_from and linear is not self._head

    @contextmanager
    def library_from_rows(self, rows: int) -> Iterator[None]:
        """Within this context, inputs of ``rows`` rows or more (a long prompt's prefill) multiply through
        the default kernel (MKL's large GEMM), but the output head's."""
        before, self.library_from = self.library_from, rows
        try:
            yield
        finally:
            self.library_from = before

    @contextmanager
    def rows(self) -> Iterator[None]:
        """Within this context, linears whose input row count has a pack use it."""
        self._reclaim()
        self.active = True
        try:
            yield
        finally:
            self.active = False

    def _reclaim(self) -> None:
        """Take back the linears a later ``PackedGemm`` of the same modules took over (a second runtime
        drafter over one model, another ``Backends`` over one target) and make again the packs this one
        had made: otherwise they would multiply through the default kernel inside :meth:`rows`, which
        differs from the packs' products by rounding (by much more where a drafter's packs hold rounded
        codes), and ``tune`` would count drafts that decoding does not propose."""
        if self._takeovers_seen == PackedGemm.takeovers:
            return
        taken = [module for module in self._linears if module._owner is not self]
        for module in taken:
            module._packs, module._owner = {}, self
        if taken:
            PackedGemm.takeovers += 1
            PackedGemm.ownership_changes += 1
            self.generation += 1
            for key in sorted(self._made):
                self._ensure(key)
        self._takeovers_seen = PackedGemm.takeovers

    def _ensure(self, bucket: int) -> bool:
        missing = [module for module in self._linears if bucket not in module._packs]
        if not missing:
            return True
        if bucket in self._refused or self._bytes_per_bucket > MEMORY_SHARE * _available_bytes():
            self._refused.add(bucket)
            return False
        start = time.perf_counter()
        with torch.no_grad():
            for module in missing:
                module._packs[bucket], rounded = self._pack(module.weight.detach(), bucket)
                module._packed_from = CopySource(module.weight)
                (self._rounded.add if rounded else self._rounded.discard)(id(module))
        self.generation += 1
        self.pack_seconds += time.perf_counter() - start
        self._made.add(bucket)
        return True

    def _same_columns(self, stacked: torch.Tensor, packs: tuple[torch.Tensor, ...], width: int) -> bool:
        """Whether the stacked pack's product is bitwise the separate packs' products side by side."""
        rows = torch.randn(5, width, generator=torch.Generator().manual_seed(0))
        together = one_pack_product(self.kernel, rows, stacked)
        return torch.equal(together, torch.cat([one_pack_product(self.kernel, rows, pack) for pack in packs], 1))

    def pack_forms(self) -> dict[str, int]:
        """How many linears' one-row packs hold each form of their weights (:data:`PACK_FORMS`)."""
        forms: dict[str, int] = {}
        for module in self._linears:
            pack = module._packs.get(self.pack_key(1))
            if pack is not None:
                form = pack_form(pack, id(module) in self._rounded)
                forms[form] = forms.get(form, 0) + 1
        return forms

    def _pack(self, weight: torch.Tensor, bucket: int, may_round: bool = True) -> tuple[torch.Tensor, bool]:
        """The pack of ``weight`` and whether it holds the weights rounded (:attr:`round_to_codes`)."""
        if self.kernel == "stream":
            return stream_pack_made(weight, self.codes, may_round and self.round_to_codes)
        if self.kernel == "onednn":
            return one_pack(self.kernel, weight), False
        return torch.ops.mkl._mkl_reorder_linear_weight(weight, bucket), False


def _available_bytes() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
