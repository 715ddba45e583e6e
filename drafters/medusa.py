"""Medusa-1 heads: config, model, static and dynamic draft trees, and tree calibration.

K heads read the target's feature ``f_t`` (the input of its ``lm_head``); head k predicts ``x_{t+k+1}``
(the target's own head predicts ``x_{t+1}``). Head k is ``num_layers`` ResBlocks
(``x + SiLU(Linear(h, h)(x))``, Linear zero-initialised, so a fresh block is the identity) then
``Linear(h, V)`` initialised from the target's ``lm_head``: a fresh head k repeats the target's
next-token guess, and training only has to learn the shift.

Drafting reads one feature, the one that produced the root token (the last committed feature), so
head k's candidates are the depth-k nodes of the tree, and a node's token depends only on its depth
and rank (Medusa's Cartesian trees). The tree comes from choice paths (``[0, 1, 0]`` = rank 0 of
head 1, rank 1 of head 2, rank 0 of head 3), from a shipped default, from ``draftsmith medusa
calibrate`` (written into the exported ``config.json``), or is grown best-first by cumulative head
log-probability (``tree: dynamic``). Verification is the runtime's lossless rule; Medusa's typical
acceptance is lossy and is not offered.

State-dict keys follow the original Medusa layout (``medusa_head.{k}.{i}.linear.weight`` for the
ResBlocks, ``medusa_head.{k}.{num_layers}.weight`` for the output layer, head k = 0-based), so the
weights of an original Medusa-1 checkpoint with the full vocabulary load by name.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from draftsmith.core.drafting import DraftContext, Drafter, committed_features
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.tree import DraftTree, cartesian_tree
from draftsmith.drafters.base import (
    TREE_LIMITS,
    DrafterConfig,
    DrafterModel,
    DraftVocabMixin,
    FrozenTarget,
    TreeOptions,
)
from draftsmith.drafters.engine_layouts import EngineExport, EngineLayoutError, Verifier

DYNAMIC = "dynamic"

# Per-head top-k accuracies (rows: heads 1..4, columns: ranks 0..4) shaped like the ones the Medusa
# paper reports for a trained Medusa-1; the shipped trees are calibrated on this nominal profile.
# `draftsmith medusa calibrate` replaces it with the accuracies measured for a trained drafter.
NOMINAL_ACCURACY = (
    (0.60, 0.10, 0.05, 0.03, 0.02),
    (0.40, 0.10, 0.05, 0.03, 0.02),
    (0.30, 0.08, 0.04, 0.03, 0.02),
    (0.22, 0.07, 0.04, 0.02, 0.02),
)


class MedusaTreeError(DraftsmithError, ValueError):
    """A tree specification (name, choice paths or calibration file) that cannot be used."""


def calibrated_paths(accuracy: Sequence[Sequence[float]], nodes: int) -> list[list[int]]:
    """The ``nodes`` choice paths with the highest path probability, where a path's probability is the
    product of ``accuracy[depth - 1][rank]`` along it (rank r of head k is the accepted token).

    Under that model the expected acceptance length of a tree is ``1 + sum of its paths'
    probabilities``, and since a child never scores above its parent (accuracies <= 1), taking the
    best paths one at a time keeps the tree prefix-closed and maximises the sum. Ties break on the
    lexicographically smaller path, so the result is deterministic."""
    chosen: list[list[int]] = []
    heap = [(-float(p), (rank,)) for rank, p in enumerate(accuracy[0])] if accuracy else []
    heapq.heapify(heap)
    while heap and len(chosen) < nodes:
        negative, path = heapq.heappop(heap)
        chosen.append(list(path))
        if len(path) < len(accuracy):
            for rank, p in enumerate(accuracy[len(path)]):
                heapq.heappush(heap, (negative * float(p), path + (rank,)))
    return sorted(chosen, key=lambda p: (len(p), p))


def expected_accept_length(paths: Sequence[Sequence[int]], accuracy: Sequence[Sequence[float]]) -> float:
    """``1 + sum over nodes of P(node accepted)`` under independent per-head rank accuracies."""
    total = 1.0
    for path in paths:
        probability = 1.0
        for depth, rank in enumerate(path):
            row = accuracy[depth] if depth < len(accuracy) else ()
            probability *= float(row[rank]) if rank < len(row) else 0.0
        total += probability
    return total


DEFAULT_TREES: dict[str, list[list[int]]] = {
    f"medusa-{n}": calibrated_paths(NOMINAL_ACCURACY, n) for n in (8, 16, 32, 64)
}


def _closed_paths(paths: Sequence[Sequence[int]], num_heads: int) -> list[tuple[int, ...]]:
    """Validated paths plus all their prefixes, ordered by depth then ranks (parents first)."""
    closed: set[tuple[int, ...]] = set()
    for path in paths:
        if not isinstance(path, (list, tuple)) or not path:
            raise MedusaTreeError(f"a Medusa choice path must be a non-empty list of ranks, got {path!r}")
        if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in path):
            raise MedusaTreeError(f"choice path {list(path)} holds a rank that is not an integer >= 0")
        if len(path) > num_heads:
            raise MedusaTreeError(f"choice path {list(path)} is {len(path)} deep but the drafter has {num_heads} heads")
        closed.update(tuple(path[:depth]) for depth in range(1, len(path) + 1))
    return sorted(closed, key=lambda p: (len(p), p))


def resolve_tree(tree: str | Sequence[Sequence[int]], num_heads: int) -> list[tuple[int, ...]] | None:
    """Choice paths of a tree spec (a shipped name or explicit paths), or None for the dynamic mode.

    A shipped tree deeper than the drafter's heads is cut to ``num_heads`` levels; explicit paths
    must fit."""
    if isinstance(tree, str):
        if tree == DYNAMIC:
            return None
        if tree not in DEFAULT_TREES:
            raise MedusaTreeError(
                f"unknown Medusa tree {tree!r}; use one of {', '.join(DEFAULT_TREES)}, {DYNAMIC!r}, "
                "or a list of choice paths such as [[0], [1], [0, 0]]"
            )
        return _closed_paths([p for p in DEFAULT_TREES[tree] if len(p) <= num_heads], num_heads)
    if not tree:
        raise MedusaTreeError("a Medusa tree needs at least one choice path")
    return _closed_paths(tree, num_heads)


@dataclass(frozen=True)
class StaticTree:
    """A Medusa tree shape: node i is rank ``ranks[i]`` of head ``depths[i]``, below ``parents[i]``."""

    paths: tuple[tuple[int, ...], ...]
    parents: tuple[int, ...]
    depths: tuple[int, ...]
    ranks: tuple[int, ...]

    @classmethod
    def from_paths(cls, paths: Sequence[tuple[int, ...]]) -> StaticTree:
        index = {path: i for i, path in enumerate(paths)}
        parents = tuple(index[p[:-1]] if len(p) > 1 else -1 for p in paths)
        return cls(tuple(paths), parents, tuple(len(p) for p in paths), tuple(p[-1] for p in paths))

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    def top_k(self, depth: int) -> int:
        """How many candidates head ``depth`` must rank for this tree."""
        return 1 + max(r for r, d in zip(self.ranks, self.depths) if d == depth)

    def draft(self, candidates: Sequence[Sequence[int]]) -> DraftTree:
        """The draft tree given each head's ranked token ids (``candidates[depth - 1][rank]``)."""
        tokens = [candidates[d - 1][r] for d, r in zip(self.depths, self.ranks)]
        return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(self.parents, dtype=torch.long))


class MedusaConfig(DrafterConfig):
    """Shape of the Medusa heads and the tree they draft by default.

    Options: ``num_heads`` heads of ``num_layers`` ResBlocks each. ``tree``: a shipped tree
    (``medusa-8``, ``-16``, ``-32``, ``-64`` nodes), explicit choice paths, or ``dynamic`` (best-first by
    cumulative head log-probability, ``top_k`` candidates per head, ``total_tokens`` nodes). The small
    trees suit a CPU. ``draft_vocab_size`` > 0 gives each head an output layer over only that many
    tokens, the most frequent in the training data: a full-vocabulary head is as large as the target's
    lm_head, and K of them cost about as much as the target forward on a CPU. Verification stays
    lossless."""

    model_type = "draftsmith_medusa"
    TREE_OPTIONS = ("tree", "top_k", "total_tokens")
    DERIVED = ("hidden_size", "vocab_size", "tree_calibration")
    error = MedusaTreeError

    def __init__(
        self,
        hidden_size: int = 0,
        vocab_size: int = 0,
        num_heads: int = 4,
        num_layers: int = 1,
        draft_vocab_size: int = 0,
        tree: str | list[list[int]] = "medusa-16",
        top_k: int = 4,
        total_tokens: int = 16,
        tree_calibration: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.num_heads = num_heads
        self.num_layers = num_layers
        self.draft_vocab_size = draft_vocab_size
        self.tree = tree
        self.top_k = top_k
        self.total_tokens = total_tokens
        self.tree_calibration = tree_calibration  # what `draftsmith medusa calibrate` measured
        kwargs.setdefault("drafter_family", "medusa")
        super().__init__(**kwargs)

    @classmethod
    def from_target_config(cls, target_config: PretrainedConfig) -> dict[str, Any]:
        return {"hidden_size": int(target_config.hidden_size), "vocab_size": int(target_config.vocab_size)}

    def check(self) -> None:
        super().check()
        depth = TREE_LIMITS["depth"]  # a head per draft depth, and no head deeper than a tree (1 block is Medusa's)
        if not (1 <= self.num_heads <= depth and 0 <= self.num_layers <= depth and self.draft_vocab_size >= 0):
            raise MedusaTreeError(
                f"drafter.num_heads must be from 1 to {depth} (a head per draft depth), num_layers from 0 to {depth} "
                f"and draft_vocab_size >= 0; got {self.num_heads}, {self.num_layers} and {self.draft_vocab_size}"
            )
        paths = resolve_tree(self.tree, self.num_heads)  # a bad tree is a recipe error now, not at the first decode
        if self.draft_vocab_size > self.vocab_size:
            raise MedusaTreeError(
                f"drafter.draft_vocab_size {self.draft_vocab_size} exceeds the vocabulary ({self.vocab_size})"
            )
        deepest_rank = max((rank for path in paths or () for rank in path), default=0)
        if self.vocab_size and deepest_rank >= self.head_vocab_size:  # vocab_size is 0 before it is derived
            raise MedusaTreeError(
                f"drafter.tree ranks a head's candidate {deepest_rank}, but each head has "
                f"{self.head_vocab_size} outputs"
            )

    @property
    def head_vocab_size(self) -> int:
        return self.draft_vocab_size or self.vocab_size


class ResBlock(nn.Module):
    """``x + SiLU(Linear(x))``; the Linear starts at zero, so a fresh block is the identity."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


def build_head(hidden: int, vocab: int, num_layers: int) -> nn.Sequential:
    # One fresh ResBlock per layer: `[ResBlock(h)] * n` would share a single block n times.
    return nn.Sequential(*(ResBlock(hidden) for _ in range(num_layers)), nn.Linear(hidden, vocab, bias=False))


class MedusaHeads(DraftVocabMixin, DrafterModel):
    """``forward(per_head_features)``: head k (0-based) reads ``per_head_features[k]`` (N_k, h) and
    returns its logits (N_k, V'). Each head gets its own rows because the loss supervises head k only
    where ``x_{t+k+1}`` exists; everything goes through ``forward`` so DDP and DeepSpeed see it."""

    config_class = MedusaConfig

    def __init__(self, config: MedusaConfig) -> None:
        super().__init__(config)
        h, v = config.hidden_size, config.head_vocab_size
        self.medusa_head = nn.ModuleList(build_head(h, v, config.num_layers) for _ in range(config.num_heads))
        self._register_draft_vocab(config.draft_vocab_size)  # token ids of the outputs (empty = all)
        self._initialised_from_target = False

    def forward(self, per_head_features: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if len(per_head_features) != len(self.medusa_head):
            raise ValueError(f"expected inputs for {len(self.medusa_head)} heads, got {len(per_head_features)}")
        return [head(x) for head, x in zip(self.medusa_head, per_head_features)]

    def all_heads(self, feature: torch.Tensor, heads: int | None = None) -> torch.Tensor:
        """Every head's logits for one feature (h,) or a batch (..., h): (..., K, V'); with ``heads``,
        only the first ones'."""
        chosen = self.medusa_head[:heads]
        return torch.stack([head(feature) for head in chosen], dim=-2)

    def fit_data(self, token_counts: torch.Tensor) -> None:
        """Choose the draft vocabulary from the training data's token counts (a (V,) tensor); call it
        before :meth:`init_from_target`, which copies the lm_head rows of these tokens."""
        if self._initialised_from_target and self.config.draft_vocab_size:
            raise RuntimeError("fit_data must run before init_from_target (the heads copy the draft vocabulary's rows)")
        super().fit_data(token_counts)

    @torch.no_grad()
    def init_from_target(self, frozen: FrozenTarget) -> None:
        """Medusa's initial state: every ResBlock the identity, every output layer a copy of the target's
        ``lm_head`` (its draft-vocabulary rows). ``frozen`` is a ``FrozenTarget`` (anything with ``lm_head``)."""
        weight = frozen.lm_head.weight
        if getattr(frozen.lm_head, "bias", None) is not None:
            raise ValueError("Medusa heads have no output bias; this target's lm_head has one")
        if tuple(weight.shape) != (self.config.vocab_size, self.config.hidden_size):
            raise ValueError(
                f"the target's lm_head is {tuple(weight.shape)}, the heads were built for "
                f"({self.config.vocab_size}, {self.config.hidden_size}); build them for this target"
            )
        rows = weight[self.draft_vocab.to(weight.device)] if self.config.draft_vocab_size else weight
        for head in self.medusa_head:
            for block in head[:-1]:
                block.linear.weight.zero_()
                block.linear.bias.zero_()
            head[-1].weight.copy_(rows.to(head[-1].weight.device, head[-1].weight.dtype))
        self._initialised_from_target = True

    def runtime_drafter(self, target_model: nn.Module, tree: TreeOptions) -> MedusaTreeDrafter:
        # The heads own their output layers; the target is only the verifier.
        return MedusaTreeDrafter(self, tree, name=self.config.drafter_family)

    def engine_layout(self, fmt: str, verifier: Verifier, speculative_tokens: int | None) -> EngineExport:
        """vLLM's ``MedusaModel``: ``blocks.{k}.layers.{i}`` (the ResBlocks, with bias) and ``lm_heads.{k}``.
        vLLM drafts a chain (each head's top-1) over the whole vocabulary, so reduced-vocabulary heads
        have no place in it."""
        if fmt != "vllm":
            raise EngineLayoutError(f"a medusa drafter has no {fmt} layout; use --format vllm")
        if self.config.draft_vocab_size:
            raise EngineLayoutError(
                "vLLM's Medusa heads cover the whole vocabulary; train with drafter.draft_vocab_size=0 to serve them"
            )
        tensors = {}
        for k, head in enumerate(self.medusa_head):
            for i, block in enumerate(head[:-1]):
                tensors[f"blocks.{k}.layers.{i}.weight"] = block.linear.weight
                tensors[f"blocks.{k}.layers.{i}.bias"] = block.linear.bias
            tensors[f"lm_heads.{k}.weight"] = head[-1].weight
        config = {
            "architectures": ["MedusaModel"],
            "model_type": "medusa",
            "hidden_size": self.config.hidden_size,
            "vocab_size": self.config.vocab_size,
            "num_heads": self.config.num_heads,
            "num_hidden_layers": self.config.num_layers,
            "medusa_fc_bias": True,  # the ResBlocks' Linear has a bias (vLLM's default is none)
            "truncated_vocab_size": self.config.vocab_size,
        }
        return EngineExport(
            config=config,
            tensors={name: tensor.detach().float().cpu().contiguous() for name, tensor in tensors.items()},
            required=tuple(
                (key,) for key in ("model_type", "hidden_size", "vocab_size", "num_heads", "medusa_fc_bias")
            ),
            required_tensors=tuple(f"lm_heads.{k}.weight" for k in range(self.config.num_heads)),
            speculative_tokens=min(speculative_tokens or self.config.num_heads, self.config.num_heads),
        )


class MedusaTreeDrafter(Drafter):
    """Drafts a Medusa tree for the runtime from the last committed feature: one pass through the
    heads per round, no drafter cache (the heads see one position only)."""

    wants_features = True

    def __init__(self, model: MedusaHeads, tree: TreeOptions, name: str = "medusa") -> None:
        self.model = model.eval()
        options = tree.over(model.config.tree_options())
        paths = resolve_tree(options.tree, model.config.num_heads)
        self.static = StaticTree.from_paths(paths) if paths is not None else None
        self.top_k, self.total_tokens = options.top_k, options.total_tokens
        self.name = name

    @torch.no_grad()
    def propose(self, context: DraftContext) -> DraftTree:
        features = committed_features(context, "Medusa")
        if features.shape[0] == 0:
            raise ValueError("Medusa drafting needs the target's features of every committed token but the root")
        feature = features[-1]  # produced the root token; head k proposes the depth-k nodes
        if self.static is not None:
            return self._static_tree(feature)
        # A node needs its parent in the tree, so a budget of N nodes never reaches past depth N: the
        # heads below it would be computed for nothing (a head costs about a lm_head on a CPU).
        levels = self.model.all_heads(feature, heads=self.total_tokens)
        return cartesian_tree(levels, self.top_k, self.total_tokens, self.model.token_ids)

    def _static_tree(self, feature: torch.Tensor) -> DraftTree:
        heads = self.model.medusa_head[: self.static.max_depth]  # heads below the tree's depth are not run
        candidates = [
            self.model.token_ids(head(feature).topk(self.static.top_k(depth)).indices).tolist()
            for depth, head in enumerate(heads, start=1)
        ]
        return self.static.draft(candidates)
