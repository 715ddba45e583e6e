"""The target's verification forward compiled with ``torch.compile`` (``--compile``).

Every shape the compiled forward sees is fixed by two buckets, so a handful of graphs serve a whole
run: the query count is padded up to a **tree bucket** (1, 4, 8, 16, 32, 64, then multiples of 64),
and the KV cache is a transformers ``StaticCache`` whose length is a **context bucket** (a power of
two, at least 256) that every attention mask spans. Padded query rows hold token 0, attend only to
themselves and are never attended to by a real row, so they change no real row's logits; the keys
they write land past the committed rows and are overwritten or masked later. The prompt's prefill
runs eagerly (its length varies per prompt).

On CPU the backend is inductor; on CUDA ``mode="reduce-overhead"`` adds CUDA graphs. Compilation
happens the first time a (tree bucket, context bucket) pair is met; :attr:`CompiledTarget.compile_seconds`
says how long those first calls took. Inductor keeps compiled kernels in its cache directory
(``TORCHINDUCTOR_CACHE_DIR``; unless set, draftsmith points it at ``inductor/`` in its own cache,
``$DRAFTSMITH_CACHE`` or ``~/.cache/draftsmith``), so a second process starts faster.
"""

from __future__ import annotations

import os
import time

import torch
from transformers import StaticCache

from draftsmith.core.cache import supports_preallocation
from draftsmith.core.cache_kwarg import cache_kwargs
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.target import cache_root
from draftsmith.core.tree import DraftTree, ancestry, tree_block

TREE_BUCKETS = (1, 4, 8, 16, 32, 64)
MIN_CONTEXT_BUCKET = 256


class CompileError(DraftsmithError, ValueError):
    """A target or method the compiled path cannot serve."""


def tree_bucket(queries: int) -> int:
    """The padded query count for ``queries`` rows (the root and the tree's nodes)."""
    for bucket in TREE_BUCKETS:
        if queries <= bucket:
            return bucket
    return -(-queries // TREE_BUCKETS[-1]) * TREE_BUCKETS[-1]


def context_bucket(rows: int) -> int:
    """The static cache length for a generation needing ``rows`` cache rows: a power of two >= 256."""
    bucket = MIN_CONTEXT_BUCKET
    while bucket < rows:
        bucket *= 2
    return bucket


class StaticTreeInputs:
    """The compiled forward's inputs for one round, in buffers allocated once per context bucket: the
    additive mask ``(1, 1, B, C)`` (committed columns visible, the tree block by ancestry, padding rows
    see only themselves), the position ids ``(1, B)`` and the token ids ``(1, B)``."""

    def __init__(self, columns: int, dtype: torch.dtype, device: torch.device) -> None:
        self.columns, self.dtype, self.device = columns, dtype, device
        self._blocked = torch.finfo(dtype).min
        self._masks: dict[int, torch.Tensor] = {}
        self._visible: dict[int, int] = {}  # per bucket: columns [0, n) are zero in every row

    def build(self, root: int, tree: DraftTree, past: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        allowed, depths = ancestry(tree.parents)
        q = allowed.shape[0]
        bucket = tree_bucket(q)
        if past + bucket > self.columns:
            raise ValueError(f"{past} cached rows and a {bucket}-row tree exceed the static cache ({self.columns})")
        mask = self._masks.get(bucket)
        if mask is None or past < self._visible[bucket]:
            mask = torch.full((1, 1, bucket, self.columns), self._blocked, dtype=self.dtype, device=self.device)
            self._masks[bucket], self._visible[bucket] = mask, 0
        visible = self._visible[bucket]
        if past > visible:
            mask[..., visible:past] = 0
            self._visible[bucket] = past
        mask[0, 0, :, past : past + bucket].copy_(tree_block(allowed, bucket, self.dtype))
        positions = torch.full((1, bucket), past, dtype=torch.long)
        positions[0, :q] += depths
        tokens = torch.zeros((1, bucket), dtype=torch.long)
        tokens[0, 0] = root
        tokens[0, 1:q] = tree.tokens
        return tokens.to(self.device), mask, positions.to(self.device)


class CompiledTarget:
    """A target whose verification forward is compiled per bucket (see the module docstring). One
    instance serves many generations; each gets a fresh static cache from :meth:`new_cache`.
    ``backend`` is torch.compile's (tests use ``aot_eager`` to check the bucketing logic quickly)."""

    def __init__(self, model: torch.nn.Module, backend: str = "inductor") -> None:
        if not supports_preallocation(model.config):
            raise CompileError(
                "--compile needs a target whose layers all use full attention (no sliding window); "
                "run without --compile"
            )
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "inductor"))
        self.model = model
        device = next(model.parameters()).device
        mode = "reduce-overhead" if device.type == "cuda" else None  # CUDA graphs on GPU
        # dynamic=False: shapes come only from the buckets, so each pair compiles once, specialised.
        self._forward = torch.compile(model.forward, backend=backend, dynamic=False, mode=mode)
        self.compile_seconds = 0.0
        self.compiled_shapes: set[tuple[int, int]] = set()

    def new_cache(self, rows: int) -> StaticCache:
        return StaticCache(config=self.model.config, max_cache_len=context_bucket(rows))

    def verify(
        self,
        tokens: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        cache: StaticCache,
        past: int,
        hidden: bool,
    ):
        """One compiled forward over rows written from ``past`` on; its rows past the real queries are
        padding (ignore them). The first call of a shape compiles: it is timed into
        :attr:`compile_seconds`, then run again from the same cache state, so the time a caller
        measures around this call excludes compilation except for one extra forward."""
        shape = (tokens.shape[1], mask.shape[-1])
        if shape not in self.compiled_shapes:
            start = time.perf_counter()
            self._call(tokens, mask, positions, cache, hidden)
            _synchronize(tokens.device)
            self.compile_seconds += time.perf_counter() - start
            self.compiled_shapes.add(shape)
            for layer in cache.layers:  # the compiling call's writes are redone by the real one
                layer.cumulative_length.fill_(past)
        return self._call(tokens, mask, positions, cache, hidden)

    def _call(self, tokens, mask, positions, cache, hidden):
        return self._forward(
            input_ids=tokens,
            attention_mask=mask,
            position_ids=positions,
            **cache_kwargs(cache),
            use_cache=True,
            output_hidden_states=hidden,
        )


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def static_rows(cache: StaticCache) -> int:
    """How many rows each layer of a static cache holds."""
    return cache.layers[0].max_cache_len


def commit_static(cache: StaticCache, past: int, accepted_nodes: list[int]) -> None:
    """After a forward over ``[root, tree, padding]`` written at rows ``past, ...``: the accepted nodes'
    rows follow the root's, and the valid length ends after them (later rows are masked, then overwritten)."""
    moved = [(j, node) for j, node in enumerate(accepted_nodes) if node != j]
    length = past + 1 + len(accepted_nodes)
    if moved:
        first = moved[0][0]
        sources = torch.tensor(accepted_nodes[first:], dtype=torch.long) + past + 1
        destination = past + 1 + first
        for layer in cache.layers:
            index = sources.to(layer.keys.device)
            layer.keys[:, :, destination:length] = layer.keys.index_select(2, index)
            layer.values[:, :, destination:length] = layer.values.index_select(2, index)
    for layer in cache.layers:
        layer.cumulative_length.fill_(length)
