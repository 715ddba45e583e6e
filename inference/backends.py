"""How the runtime's verification forwards run: a backend per generation with ``new_cache``, ``prefill``,
``verify`` and ``commit``, chosen once from the :class:`KernelOptions` and the drafter, so the decoding
loop (:func:`~draftsmith.inference.runtime.generate`) never asks which kernel runs.

:class:`EagerBackend` runs the model eagerly on the runtime's preallocated cache, through the fast paths
of the model's :class:`KernelContext` (direct forward, C++ layers, packed GEMM, screened greedy head).
:class:`CompiledBackend` runs the compiled, bucketed forwards of :class:`CompiledTarget` on a static cache.
:class:`Backends` makes them and owns what outlives a generation (kernel contexts, compiled graphs).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import nn

from draftsmith.core.cache import commit_tree_path, preallocated_cache_for
from draftsmith.core.cache_kwarg import cache_kwargs
from draftsmith.core.drafting import Drafter
from draftsmith.core.tree import DraftTree, TreeInputBuffers, masks_per_layer_type
from draftsmith.inference.kernels.compiled import (
    CompiledTarget,
    StaticTreeInputs,
    commit_static,
    static_rows,
    tree_bucket,
)
from draftsmith.inference.kernels.context import KernelContext
from draftsmith.inference.kernels.direct import AnyDirectForward
from draftsmith.inference.kernels.greedy_head import GreedyHead
from draftsmith.inference.kernels.native import native_extension
from draftsmith.inference.kernels.native_drafter import NativeDrafterLayer
from draftsmith.inference.kernels.options import KernelOptions
from draftsmith.inference.kernels.packed_gemm import ONE_PACK_KERNELS, PackedGemm, linear_kernel_for

# Tree rows the preallocated buffers leave room for beyond the committed tokens; a bigger tree grows them.
DEFAULT_TREE_ROOM = 64


@dataclass
class GreedyForward:
    """A verification forward that computed only the target's argmax at its rows (no logits)."""

    predictions: list[int]  # token ids over [root, nodes]
    hidden_states: tuple[torch.Tensor, ...] | None


@dataclass(frozen=True)
class FastPaths:
    """The optional fast paths of an eager verification forward (none: the model's own forward). With
    ``gemm``, a multi-row forward is padded to its packed row bucket (rows past ``1 + len(tree)`` of the
    output are padding); ``packs_checked``: its packs were made fresh earlier in this generation
    (:meth:`PackedGemm.padded_rows`). With ``direct`` (built for the model), the forward skips
    transformers' per-call machinery, bitwise the same (``direct_forward.py``). With ``greedy`` (the
    model's screened head, computed through ``native``, the C++ extension where given), the forward
    returns a :class:`GreedyForward`: the float32 head's argmax per row, without its logits, after the
    direct forward or, without one, the model's own base model (the head's input is its last state:
    :func:`screened_head_serves`)."""

    gemm: PackedGemm | None = None
    direct: AnyDirectForward | None = None
    greedy: GreedyHead | None = None
    native: ModuleType | None = None
    packs_checked: bool = False


def verification_forward(
    model,
    cache,
    tree_inputs: TreeInputBuffers,
    root: int,
    tree: DraftTree,
    past: int,
    hidden: bool,
    paths: FastPaths = FastPaths(),
):
    """The verification forward over ``[root, tree]`` on top of ``past`` cached rows, uncompiled, through
    ``paths``' fast paths (:class:`FastPaths`)."""
    gemm, direct, greedy = paths.gemm, paths.direct, paths.greedy
    device = tree_inputs.device
    rows = gemm.padded_rows(1 + len(tree), paths.packs_checked) if gemm is not None else 0  # (makes the packs it uses)
    if len(tree):
        mask, positions = tree_inputs.build(tree, past, rows)
        mask = masks_per_layer_type(model.config, mask, positions)  # one per layer type where they differ
    else:  # the root alone sees every cached key: no mask, as in plain decoding
        mask, positions = None, torch.tensor([[past]], device=device)
    input_ids = torch.full((1, positions.shape[1]), root, dtype=torch.long)
    if len(tree):
        input_ids[0, 1 : 1 + len(tree)] = tree.tokens
    # the row-invariant attention reads grouped K/V heads as they are under any mask: no SDPA call to switch
    grouping = nullcontext() if direct is not None and direct.rows_attention else _grouped_kv_heads(device)
    with gemm.rows() if gemm is not None else nullcontext(), grouping:
        if direct is not None:
            out = direct(input_ids.to(device), positions, mask, cache, hidden, head=greedy is None)
        else:
            out = (model if greedy is None else model.model)(
                input_ids.to(device),
                attention_mask=mask,
                position_ids=positions,
                **cache_kwargs(cache),
                use_cache=True,
                output_hidden_states=hidden,
            )
        if greedy is None:
            return out
        tokens = greedy.token_list(out.last_hidden_state[0, : 1 + len(tree)], paths.native)
        return GreedyForward(tokens, out.hidden_states)


@contextmanager
def _grouped_kv_heads(device: torch.device) -> Iterator[None]:
    """On a CPU, let SDPA read grouped-query K/V heads as they are (``enable_gqa``) under a tree mask too.
    Transformers otherwise copies every cached key and value ``num_key_value_groups`` times per layer
    whenever a mask is given: work that grows with the context, with bit-identical results on CPU. CUDA
    keeps the copy (its fused kernels take no mask with grouped heads). Transformers' only switch is an
    environment variable read at every attention call, so it is set for the verification forward alone
    (every other forward in the process, the HF baseline's included, keeps transformers' default)."""
    if device.type != "cpu" or os.environ.get(_FORCE_GQA) is not None:
        yield
        return
    os.environ[_FORCE_GQA] = "1"
    try:
        yield
    finally:
        del os.environ[_FORCE_GQA]


_FORCE_GQA = "TRANSFORMERS_SDPA_FORCE_GQA"


class _Backend:
    """What both backends share: the model verified, the prefill, and the context-window check."""

    def __init__(self, model: nn.Module, last_logits_only: bool, drafter_gemm: PackedGemm | None = None) -> None:
        self.model = model
        parameter = next(model.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype
        self._last_logits_only = last_logits_only
        self._limit = getattr(model.config, "max_position_embeddings", None)
        self._drafter_gemm = drafter_gemm
        self._compile_before, self._setup_before = self._compile_total(), self._setup_total()
        if drafter_gemm is not None:
            drafter_gemm.padded_rows(1)  # packs the drafter's linears (again, if its weights changed): setup

    def drafting(self) -> AbstractContextManager[None]:
        """The context of the drafter's rounds: its own linears through their packs, where it has them."""
        return self._drafter_gemm.rows() if self._drafter_gemm is not None else nullcontext()

    def prefill(self, cache, prompt_ids: list[int], hidden: bool):
        """The prompt's forward (eager: its length varies per prompt). The prompt's logits matter at its
        last token only: a bare target (like HF generate) skips the lm_head over every other row, while
        verifier models keep their own full-logits contract."""
        keep = {"logits_to_keep": 1} if self._last_logits_only else {}
        prompt = torch.tensor([prompt_ids], device=self.device)
        return self.model(prompt, **cache_kwargs(cache), use_cache=True, output_hidden_states=hidden, **keep)

    def fits(self, cache, past: int, tree: DraftTree) -> bool:
        """Whether ``tree`` can be verified on top of ``past`` committed rows: not past the model's
        context window (no speculation there)."""
        return self._limit is None or past + 1 + len(tree) <= self._limit

    def compile_seconds(self) -> float:
        """Seconds spent compiling new shapes since this backend was made."""
        return self._compile_total() - self._compile_before

    def setup_seconds(self) -> float:
        """Seconds spent building kernels (packs, the screened head, the C++ layers) since it was made."""
        return self._setup_total() - self._setup_before

    def _compile_total(self) -> float:
        return 0.0

    def _setup_total(self) -> float:
        return self._drafter_gemm.pack_seconds if self._drafter_gemm is not None else 0.0


@dataclass
class EagerCache:
    """One generation's preallocated KV cache and the tree-mask buffers that go with it."""

    kv: Any
    tree_inputs: TreeInputBuffers


class EagerBackend(_Backend):
    """Eager verification forwards on the runtime's preallocated cache, through ``kernels``' fast paths
    (None: the model's own forward, as for a drafter's verifier model); ``greedy``: the screened head
    may answer instead of the logits."""

    def __init__(
        self, model: nn.Module, kernels: KernelContext | None, greedy: bool, drafter_gemm: PackedGemm | None = None
    ) -> None:
        self.kernels = kernels
        super().__init__(model, last_logits_only=kernels is not None, drafter_gemm=drafter_gemm)
        greedy_head = kernels.greedy_head() if kernels is not None and greedy else None
        self._paths = FastPaths(
            gemm=kernels.gemm if kernels is not None else None,
            direct=kernels.direct() if kernels is not None else None,
            greedy=greedy_head,
            native=kernels.extension() if greedy_head is not None else None,
            packs_checked=kernels is not None,  # by this generation's prefill (model_forwards)
        )

    def new_cache(self, capacity: int) -> EagerCache:
        kv = preallocated_cache_for(self.model.config, capacity)
        return EagerCache(kv, TreeInputBuffers(DEFAULT_TREE_ROOM, capacity, self.dtype, self.device))

    def prefill(self, cache: EagerCache, prompt_ids: list[int], hidden: bool):
        with self.kernels.model_forwards() if self.kernels is not None else nullcontext():
            return super().prefill(cache.kv, prompt_ids, hidden)

    def verify(self, cache: EagerCache, root: int, tree: DraftTree, past: int, hidden: bool):
        with self.kernels.attention() if self.kernels is not None and self._paths.direct is None else nullcontext():
            return verification_forward(self.model, cache.kv, cache.tree_inputs, root, tree, past, hidden, self._paths)

    def commit(self, cache: EagerCache, past: int, accepted_nodes: list[int]) -> None:
        commit_tree_path(cache.kv, past, accepted_nodes)

    def _setup_total(self) -> float:
        return super()._setup_total() + (self.kernels.setup_seconds if self.kernels is not None else 0.0)


@dataclass
class CompiledCache:
    """One generation's static KV cache and the compiled forward's input buffers."""

    kv: Any
    inputs: StaticTreeInputs


class CompiledBackend(_Backend):
    """Verification forwards through ``compiled``'s graphs, padded to tree buckets on a static cache."""

    def __init__(self, compiled: CompiledTarget, drafter_gemm: PackedGemm | None = None) -> None:
        self.compiled = compiled
        super().__init__(compiled.model, last_logits_only=True, drafter_gemm=drafter_gemm)

    def new_cache(self, capacity: int) -> CompiledCache:
        kv = self.compiled.new_cache(capacity)
        return CompiledCache(kv, StaticTreeInputs(static_rows(kv), self.dtype, self.device))

    def prefill(self, cache: CompiledCache, prompt_ids: list[int], hidden: bool):
        return super().prefill(cache.kv, prompt_ids, hidden)

    def fits(self, cache: CompiledCache, past: int, tree: DraftTree) -> bool:
        """Also: the tree's bucket fits the static cache's spare rows."""
        return super().fits(cache, past, tree) and past + tree_bucket(1 + len(tree)) <= cache.inputs.columns

    def verify(self, cache: CompiledCache, root: int, tree: DraftTree, past: int, hidden: bool):
        return self.compiled.verify(*cache.inputs.build(root, tree, past), cache.kv, past, hidden)

    def commit(self, cache: CompiledCache, past: int, accepted_nodes: list[int]) -> None:
        commit_static(cache.kv, past, accepted_nodes)

    def _compile_total(self) -> float:
        return self.compiled.compile_seconds


VerifyBackend = EagerBackend | CompiledBackend


class Backends:
    """The verification backends of a run with one set of :class:`KernelOptions`: it owns each model's
    :class:`KernelContext` and the target's :class:`CompiledTarget`, made on first use, so a caller that
    decodes many prompts (``bench``, ``tune``) keeps one and builds each kernel once. ``compile_backend``
    is torch.compile's (tests use ``aot_eager`` to check the bucketing quickly)."""

    def __init__(self, options: KernelOptions | None = None, compile_backend: str = "inductor") -> None:
        self.options = options or KernelOptions()
        self._compile_backend = compile_backend
        self._kernels: dict[int, KernelContext] = {}  # by id(model); the context holds the model alive
        # by id(drafter module), held beside its packs: a drafter's own modules may be a wrapper made for it
        # (model and head), whose id a later drafter's wrapper could reuse once it is collected
        self._drafter_gemms: dict[int, tuple[nn.Module, PackedGemm]] = {}
        self._compiled: CompiledTarget | None = None
        self._drafter_layer: NativeDrafterLayer | None = None

    def kernels(self, model: nn.Module) -> KernelContext:
        """``model``'s kernel context."""
        if id(model) not in self._kernels:
            self._kernels[id(model)] = KernelContext(model, self.options)
        return self._kernels[id(model)]

    def drafter_gemm(self, drafter: Drafter) -> PackedGemm | None:
        """The packs of ``drafter``'s own linears (:meth:`Drafter.own_modules`) where the options use a
        kernel with one pack for every row count (stream, oneDNN) that serves the drafter (float32 on the
        CPU); a drafter's rounding changes only which tokens it proposes, so this needs no row invariance.
        None: it runs as it is."""
        module = drafter.own_modules()
        if module is None:
            return None
        options = self.options
        kernel = linear_kernel_for(module, options.linear, options.native, options.weight_codes, options.drafter_codes)
        if kernel not in ONE_PACK_KERNELS:
            return None
        if id(module) not in self._drafter_gemms:
            gemm = PackedGemm(module, kernel, options.weight_codes, options.drafter_codes)
            self._drafter_gemms[id(module)] = (module, gemm)
        return self._drafter_gemms[id(module)][1]

    def drafting_kernels(self, drafter: Drafter) -> PackedGemm | None:
        """Give ``drafter`` the kernels it drafts with in decoding: the C++ layer forward, and its linears'
        packs (returned; active inside their ``rows()``), so that what it proposes outside ``generate``
        (``tune``'s records) is what it proposes there."""
        drafter.use_layer_kernel(self.drafter_layer_kernel())
        return self.drafter_gemm(drafter)

    def drafter_layer_kernel(self) -> NativeDrafterLayer | None:
        """The C++ layer forward offered to feature drafters (:mod:`kernels.native_drafter`) where the
        options allow the extension and it builds; it serves only what it can (float32 on the CPU)."""
        if not self.options.native:
            return None
        if self._drafter_layer is None:
            extension = native_extension()
            self._drafter_layer = NativeDrafterLayer(extension) if extension is not None else None
        return self._drafter_layer

    def compiled(self, model: nn.Module) -> CompiledTarget:
        """The compiled forwards of ``model`` (the run's target: one per run)."""
        if self._compiled is None or self._compiled.model is not model:
            self._compiled = CompiledTarget(model, backend=self._compile_backend)
        return self._compiled

    def reference_forwards(self, model: nn.Module) -> AbstractContextManager[None]:
        """The context that makes ``model``'s own forwards outside the runtime (the reference ``generate``
        of ``bench`` and the tests) the runtime's numerical model: its linears through the same packs
        where the runtime's plain steps use them and its attention (:meth:`KernelContext.model_forwards`)."""
        if self.options.compiled:
            return nullcontext()
        return self.kernels(model).model_forwards()

    def prepare(self, model: nn.Module) -> None:
        """Build what decoding on ``model`` will use (compiled target; direct forward, C++ layers and
        screened head) now, outside every timing, and refuse a target the options cannot serve."""
        if self.options.compiled:
            self.compiled(model)
            return
        kernels = self.kernels(model)
        kernels.direct()
        kernels.greedy_head()

    def for_generation(self, model: nn.Module, drafter: Drafter, reads_logits: bool) -> VerifyBackend:
        """The backend verifying ``drafter``'s trees on ``model``: its verifier model's own forward where
        it has one, eager forwards of the model it serves where it serves one (neither compiles), else
        the target's compiled or eager forwards as the options say. ``reads_logits``: greedy tokens alone
        will not do (sampling, or a drafter that reads the logits)."""
        verifier = drafter.verifier_model()
        gemm = self.drafting_kernels(drafter)
        if verifier is not None:
            return EagerBackend(verifier, None, greedy=False, drafter_gemm=gemm)
        served = drafter.served_model()
        if served is None and self.options.compiled:
            return CompiledBackend(self.compiled(model), drafter_gemm=gemm)
        model = served if served is not None else model
        return EagerBackend(model, self.kernels(model), greedy=not reads_logits, drafter_gemm=gemm)
