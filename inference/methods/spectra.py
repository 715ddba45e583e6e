"""SPECTRA-CORE: a training-free drafter built from n-gram dictionaries the target fills itself.

Following the SPECTRA paper (seed 000, Algorithm 1):

* ``S_fwd[token]`` holds continuations seen after ``token`` (quantity of guesses);
  ``S_bwd[ngram]`` holds the token seen after an n-gram (quality: one guess built token by token).
* A candidate pool of ``W`` sequences rides along in every verification forward as extra tree
  branches. The target's logits at a sequence's last node predict its next token: with probability
  ``1 - τ`` the most likely of the top-``refine_top_k`` tokens that is not yet a key of ``S_fwd``
  (coverage), otherwise the plain argmax. A sequence that reaches ``N`` tokens has its n-gram and
  every sub-n-gram added to both dictionaries, then slides one token left.
* Guesses: the backward (``S_bwd``) guess first, then ``S_fwd`` continuations of the last token,
  most recent first, at most ``G`` in all; optional retrieval guesses fill what is left of ``G``.

All guesses and pool sequences are merged into one :class:`DraftTree` (shared prefixes share nodes),
verified by the runtime's ordinary lossless rules: pool branches are just more deterministic drafts,
so they can even be accepted. Nothing here can change what is committed, only how fast.

Deviations from the paper, chosen for this runtime and a CPU:

* The committed context (prompt and output) is also indexed into the dictionaries
  (``index_context``), as Lookahead's "pool from prompt" does; it is free, the pool costs tree nodes.
* ``max_tree_tokens`` caps the tree and ``pool_per_round`` the pool sequences per forward: on a CPU
  a forward's cost grows with its tree tokens much faster than the acceptance length grows with the
  tree (``bench-tree`` and ``bench`` measure both). So the CPU default keeps 12 nodes: guesses first
  in priority order (truncated to fit, 4 nodes held back for the pool), then one pool sequence,
  round-robin, so all ``W`` sequences still advance, only more slowly. ``SpectraConfig.paper()``
  (method ``spectra-paper``) lifts both limits, as on a GPU.
* The backward guess is placed first instead of last, so a cap never drops the best guess.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from draftsmith.core.drafting import DraftContext, Drafter
from draftsmith.core.tree import DraftTree
from draftsmith.core.verify import Verdict
from draftsmith.inference.methods.spectra_retrieval import RetrievalIndex


@dataclass
class SpectraConfig:
    """SPECTRA-CORE settings; ``N``, ``W``, ``G`` and ``τ`` default to the paper's values."""

    ngram: int = 5  # N: n-gram size of the pool and the dictionaries
    pool_width: int = 15  # W: candidate pool sequences
    max_guesses: int = 15  # G: guesses per round (pool branches not counted)
    refine: float = 0.1  # τ: chance of taking the plain argmax instead of an unseen token
    refine_top_k: int = 8  # how far down the ranking an "unseen" pool token may be
    max_tree_tokens: int | None = 12  # cap on tree nodes (CPU); None = no cap
    pool_per_round: int | None = 1  # pool sequences riding along per forward (CPU); None = all that fit
    max_continuations: int = 16  # S_fwd entries kept per key (most recent)
    index_context: bool = True  # also learn n-grams from the committed context
    retrieval_length: int = 6  # tokens per retrieval guess
    seed: int = 0

    def __post_init__(self) -> None:
        if self.ngram < 2 or self.pool_width < 0 or self.max_guesses < 1 or not 0.0 <= self.refine <= 1.0:
            raise ValueError("SPECTRA needs ngram >= 2, pool_width >= 0, max_guesses >= 1 and 0 <= refine <= 1")
        if self.max_tree_tokens is not None and self.max_tree_tokens < 1:
            raise ValueError("max_tree_tokens must be positive (or None for no cap)")

    @classmethod
    def paper(cls, **overrides) -> SpectraConfig:
        """The paper's setting: N=5, W=15, G=15, τ=0.1, the whole pool in every forward and no cap on
        the tree (for GPUs, where a forward over ~100 tokens costs about as much as over one)."""
        return cls(**{"max_tree_tokens": None, "pool_per_round": None, **overrides})


@dataclass
class NgramStore:
    """``S_fwd`` (token -> continuations, oldest first) and ``S_bwd`` (n-gram -> next token)."""

    max_continuations: int = 16
    forward: dict[int, list[tuple[int, ...]]] = field(default_factory=dict)
    backward: dict[tuple[int, ...], int] = field(default_factory=dict)

    def add_continuation(self, key: int, continuation: tuple[int, ...]) -> None:
        """Append ``continuation`` to ``S_fwd[key]`` as the most recent entry. A continuation that is a
        prefix of a stored one only refreshes it; one that extends a stored one replaces it (the tree
        would merge them anyway, and this keeps guess slots for different continuations)."""
        entries = self.forward.setdefault(key, [])
        for i, old in enumerate(entries):
            if old[: len(continuation)] == continuation or continuation[: len(old)] == old:
                longer = old if len(old) >= len(continuation) else continuation
                del entries[i]
                entries.append(longer)
                return
        entries.append(continuation)
        if len(entries) > self.max_continuations:
            del entries[0]

    def add_ngram(self, ngram: list[int] | tuple[int, ...]) -> None:
        """Algorithm 1, lines 36-41, with every sub-n-gram: ``S_fwd[c_j] += c_{j+1:}`` and
        ``S_bwd[c_a..c_b] = c_{b+1}``."""
        ngram = tuple(ngram)
        for j in range(len(ngram) - 1):
            self.add_continuation(ngram[j], ngram[j + 1 :])
            for start in range(j + 1):
                self.backward[ngram[start : j + 1]] = ngram[j + 1]

    def add_token_at_end(self, tokens: list[int], end: int, n: int) -> None:
        """Learn what the committed context says about ``tokens[end]``: every n-gram (up to ``n`` tokens)
        ending there. Called once per new position, so the context is indexed incrementally."""
        for start in range(max(0, end - n + 1), end):
            self.backward[tuple(tokens[start:end])] = tokens[end]
            self.add_continuation(tokens[start], tuple(tokens[start + 1 : end + 1]))

    def forward_guesses(self, last: int) -> list[list[int]]:
        """``S_fwd[last]``, most recent first."""
        return [list(c) for c in reversed(self.forward.get(last, []))]

    def backward_guess(self, tokens: list[int], length: int, n: int) -> list[int]:
        """Algorithm 1, lines 8-14: extend the context one token at a time with ``S_bwd``, trying the
        longest key (``n - 1`` tokens) first; stop at the first position nothing is known for."""
        guess: list[int] = []
        for _ in range(length):
            extended = tokens[-(n - 1) :] + guess
            nxt = None
            for k in range(min(n - 1, len(extended)), 0, -1):
                nxt = self.backward.get(tuple(extended[-k:]))
                if nxt is not None:
                    break
            if nxt is None:
                break
            guess.append(nxt)
        return guess


class _TreeBuilder:
    """Paths merged as in ``DraftTree.from_paths``, counting nodes so a cap can be respected."""

    def __init__(self) -> None:
        self.paths: list[list[int]] = []
        self.prefixes: set[tuple[int, ...]] = set()

    def new_nodes(self, path: list[int]) -> int:
        return sum(tuple(path[:d]) not in self.prefixes for d in range(1, len(path) + 1))

    def add(self, path: list[int], budget: int | None) -> list[int]:
        """Add ``path`` cut to what fits in ``budget`` nodes in all; returns the part added."""
        if budget is not None:
            while path and len(self.prefixes) + self.new_nodes(path) > budget:
                path = path[:-1]
        if path:
            self.paths.append(path)
            self.prefixes.update(tuple(path[:d]) for d in range(1, len(path) + 1))
        return path


def node_of_path(tree: DraftTree, path: list[int]) -> int:
    """Index of the node reached by following ``path`` from the root (the path must be in the tree)."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    node = -1
    for token in path:
        node = next(i for i in range(len(tokens)) if parents[i] == node and tokens[i] == token)
    return node


class SpectraDrafter(Drafter):
    """SPECTRA-CORE, optionally with SPECTRA-RETRIEVAL (an object with
    ``guesses(tokens, count, length) -> list[list[int]]``, see ``spectra_retrieval``)."""

    reads_logits = True  # the pool's next tokens come from the verification forward's top-k

    def __init__(self, config: SpectraConfig | None = None, retrieval=None, name: str | None = None) -> None:
        self.config = config or SpectraConfig()
        self.retrieval = retrieval
        self.name = name or ("spectra-r" if retrieval is not None else "spectra")
        self._known: list[int] = []
        self._reset([])

    # ----- state -----
    def _reset(self, prompt: list[int]) -> None:
        """A new prompt: empty dictionaries, a fresh seeded generator and a pool seeded with prompt tokens."""
        cfg = self.config
        self.store = NgramStore(cfg.max_continuations)
        self.rng = random.Random(cfg.seed)
        self.pool: list[list[int]] = [[self.rng.choice(prompt)] for _ in range(cfg.pool_width)] if prompt else []
        self._cursor = 0  # round-robin start when the cap does not leave room for the whole pool
        self._known = []
        self._last_tree: DraftTree | None = None
        self._pool_nodes: list[tuple[int, int]] = []  # (pool index, node index) in the last tree

    def _sync(self, context: DraftContext) -> None:
        """Reset on a context that does not extend what was seen, then index the new tokens."""
        tokens = context.tokens
        known = self._known
        if not known or len(tokens) < len(known) or tokens[: len(known)] != known:
            self._reset(tokens[: max(context.prompt_length, 1)])
            known = []
        if self.config.index_context:
            for end in range(max(len(known), 1), len(tokens)):
                self.store.add_token_at_end(tokens, end, self.config.ngram)
        self._known = list(tokens)

    # ----- drafting -----
    def core_guesses(self, tokens: list[int]) -> list[list[int]]:
        """The backward guess, then forward continuations of the last token; at most G, deduplicated."""
        cfg = self.config
        guesses = [self.store.backward_guess(tokens, cfg.ngram, cfg.ngram)]
        guesses += self.store.forward_guesses(tokens[-1])
        unique: list[list[int]] = []
        for guess in guesses:
            if guess and guess not in unique:
                unique.append(guess)
        return unique[: cfg.max_guesses]

    def propose(self, context: DraftContext) -> DraftTree:
        self._sync(context)
        cfg = self.config
        tokens = context.tokens
        guesses = self.core_guesses(tokens)
        if self.retrieval is not None and len(guesses) < cfg.max_guesses:
            for guess in self.retrieval.guesses(tokens, cfg.max_guesses - len(guesses), cfg.retrieval_length):
                if guess not in guesses:
                    guesses.append(guess)
        builder = _TreeBuilder()
        cap = cfg.max_tree_tokens
        pool_reserve = min(cfg.ngram - 1, cap // 2) if (cap is not None and self.pool) else 0
        for guess in guesses:
            builder.add(guess, None if cap is None else cap - pool_reserve)
        placed = self._place_pool(builder, cap)
        tree = DraftTree.from_paths(builder.paths) if builder.paths else DraftTree.empty()
        self._pool_nodes = [(i, node_of_path(tree, path)) for i, path in placed]
        self._last_tree = tree
        return tree

    def _place_pool(self, builder: _TreeBuilder, cap: int | None) -> list[tuple[int, list[int]]]:
        """Add whole pool sequences, round-robin from the cursor, while they fit under the cap."""
        placed = []
        width = len(self.pool)
        for step in range(width):
            if self.config.pool_per_round is not None and len(placed) >= self.config.pool_per_round:
                break
            index = (self._cursor + step) % width
            sequence = self.pool[index]
            if cap is not None and len(builder.prefixes) + builder.new_nodes(sequence) > cap:
                continue
            builder.add(list(sequence), cap)
            placed.append((index, list(sequence)))
        if placed:
            self._cursor = (placed[-1][0] + 1) % width
        return placed

    # ----- learning from the verification forward -----
    def observe(self, tree: DraftTree, logits: torch.Tensor, verdict: Verdict) -> None:
        """Algorithm 1, lines 25-43: predict each placed pool sequence's next token from the logits of the
        forward that verified it; full n-grams go into the dictionaries, then the sequence slides."""
        if tree is not self._last_tree:  # the runtime replaced our tree (context window): nothing to read
            return
        cfg = self.config
        for index, node in self._pool_nodes:
            sequence = self.pool[index]
            sequence.append(self._pick_pool_token(logits[node + 1]))
            if len(sequence) >= cfg.ngram:
                self.store.add_ngram(sequence)
                del sequence[0]
        self._pool_nodes = []

    def _pick_pool_token(self, row: torch.Tensor) -> int:
        """With probability ``1 - τ`` the best top-k token not yet a key of ``S_fwd``; else the argmax."""
        ranked = row.topk(min(self.config.refine_top_k, row.numel())).indices.tolist()
        if self.rng.random() > self.config.refine:
            for token in ranked:
                if token not in self.store.forward:
                    return token
        return ranked[0]


def build_spectra_drafter(target, index_path: str | None = None, paper: bool = False) -> SpectraDrafter:
    """``spectra`` (CORE) or ``spectra=INDEX`` (CORE + RETRIEVAL, index checked against ``target``);
    ``paper`` drops the CPU tree cap."""
    config = SpectraConfig.paper() if paper else SpectraConfig()
    retrieval = None
    if index_path:
        retrieval = RetrievalIndex.load(index_path, target.identity if target is not None else None)
    name = ("spectra-paper" if paper else "spectra") + ("-r" if retrieval is not None else "")
    return SpectraDrafter(config, retrieval, name=name)
