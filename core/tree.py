"""Draft token trees and the attention inputs that verify them in one target forward.

A tree holds ``n`` draft nodes in topological order (every parent before its children). Node ``i``
has a token, a parent (``-1`` = the root, i.e. the last committed token, which is not yet in the
KV cache) and, for sampled drafts, the distribution its token was sampled from. The verification forward runs over
``[root, node_0, ..., node_{n-1}]``: row 0 is the root, row ``i + 1`` is node ``i``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftTree:
    tokens: torch.Tensor  # (n,) long
    parents: torch.Tensor  # (n,) long, -1 for children of the root
    draft_dists: torch.Tensor | None = None  # (n, V): the distribution each node's token was sampled from

    def __post_init__(self) -> None:
        if self.tokens.shape != self.parents.shape or self.tokens.dim() != 1:
            raise ValueError("tokens and parents must be 1-D tensors of the same length")
        # in Python: a round's trees are a few nodes, where each tensor operation costs more than the scan
        for i, parent in enumerate(self.parents.tolist()):
            if not -1 <= parent < i:
                raise ValueError(f"node {i} has parent {parent}: parents must come before their children")

    @classmethod
    def empty(cls) -> DraftTree:
        return cls(torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long))

    @classmethod
    def chain(cls, tokens: list[int], draft_dists: torch.Tensor | None = None) -> DraftTree:
        """A single path: node i's parent is node i - 1."""
        return cls(
            torch.tensor(tokens, dtype=torch.long), torch.arange(-1, len(tokens) - 1, dtype=torch.long), draft_dists
        )

    @classmethod
    def from_paths(cls, paths: list[list[int]]) -> DraftTree:
        """Merge token paths from the root into a tree (shared prefixes become shared nodes); nodes are
        numbered in the order they first appear."""
        index: dict[tuple[int, ...], int] = {}
        tokens, parents = [], []
        for path in paths:
            for depth in range(1, len(path) + 1):
                key = tuple(path[:depth])
                if key not in index:
                    index[key] = len(tokens)
                    tokens.append(path[depth - 1])
                    parents.append(index[key[:-1]] if depth > 1 else -1)
        # Each prefix is added before its extension, so the order is topological.
        return cls(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))

    def __len__(self) -> int:
        return int(self.tokens.numel())

    def subtree(self, nodes: torch.Tensor | list[int]) -> DraftTree:
        """The tree of ``nodes`` (ascending; each one's parent among them or the root), renumbered in
        that order; e.g. what is left after pruning sub-trees."""
        nodes = torch.as_tensor(nodes, dtype=torch.long).cpu()
        position = {int(old): new for new, old in enumerate(nodes.tolist())}
        parents = self.parents[nodes].tolist()
        if any(parent >= 0 and parent not in position for parent in parents):
            raise ValueError("a sub-tree must keep the parent of every node it keeps")
        renumbered = torch.tensor([position[p] if p >= 0 else -1 for p in parents], dtype=torch.long)
        dists = None if self.draft_dists is None else self.draft_dists[nodes.to(self.draft_dists.device)]
        return DraftTree(self.tokens[nodes], renumbered, dists)

    def depths(self) -> torch.Tensor:
        """Depth of each node (children of the root have depth 1)."""
        return ancestry(self.parents)[1][1:]

    def children(self, node: int) -> list[int]:
        """Children of ``node`` (``-1`` = root), in node order."""
        return [i for i, p in enumerate(self.parents.tolist()) if p == node]

    def ancestor_mask(self) -> torch.Tensor:
        """(n + 1, n + 1) bool over [root, nodes]: row i may attend to column j (ancestor or self)."""
        return ancestry(self.parents)[0]


_BITSET_ROWS = 62  # rows whose ancestor sets fit one int64 each, as bits


def _ancestor_bits(parents: list[int]) -> tuple[list[int], list[int]]:
    """Each row of ``[root, nodes]`` (a topological tree) with its ancestors-or-self as the bits of one integer
    (its parent's and its own), and each row's depth."""
    seen, depths = [1], [0]  # the root sees itself
    for row, parent in enumerate(parents, start=1):
        seen.append(seen[parent + 1] | 1 << row)
        depths.append(depths[parent + 1] + 1)
    return seen, depths


def _small_ancestry(parents: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ancestry` of a topological tree of fewer than ``_BITSET_ROWS`` rows, from one integer per row."""
    seen, depths = _ancestor_bits(parents)
    allowed = (torch.tensor(seen)[:, None] >> torch.arange(len(seen))) & 1
    return allowed.bool(), torch.tensor(depths)


def ancestry(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ancestor-or-self matrix ``(n + 1, n + 1)`` bool and the depths ``(n + 1,)`` over
    ``[root, nodes]`` of the tree with ``parents`` (topological, -1 = root).

    A tree of up to ``_BITSET_ROWS`` rows (every round's, but ``tune``'s largest) takes each row's
    ancestors as the bits of one integer, its parent's and its own; a larger one climbs every row one
    level per step at once, so its Python loop runs once per tree level rather than once per node."""
    parents = parents.cpu()
    if parents.numel() < _BITSET_ROWS:
        return _small_ancestry(parents.tolist())
    rows = torch.arange(parents.numel() + 1)
    parent_row = torch.cat([torch.zeros(1, dtype=torch.long), parents + 1])  # the root is its own parent
    allowed = torch.zeros(rows.numel(), rows.numel(), dtype=torch.bool)
    allowed[rows, rows] = True
    allowed[:, 0] = True
    depths = (rows > 0).long()
    ancestor = parent_row.clone()
    while True:
        climbing = ancestor > 0  # rows whose current ancestor is a node, not yet the root
        if not bool(climbing.any()):
            return allowed, depths
        allowed[rows[climbing], ancestor[climbing]] = True
        depths += climbing
        ancestor = parent_row[ancestor]


class TreeInputBuffers:
    """The verification forward's additive mask, kept in one preallocated ``(1, 1, rows, columns)``
    buffer for a whole generation (or grown when a tree or the context outgrows it).

    Columns of committed tokens are zero in every row and stay so, since the committed prefix only
    grows; each round therefore writes the newly committed columns and the ``(q, q)`` tree block,
    never the whole ``(q, past + q)`` mask."""

    def __init__(self, rows: int, columns: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.dtype, self.device = dtype, torch.device(device)
        self._blocked = torch.finfo(dtype).min
        self._allocate(rows, columns)

    def _allocate(self, rows: int, columns: int) -> None:
        self.mask = torch.full((1, 1, rows, columns), self._blocked, dtype=self.dtype, device=self.device)
        self._zeroed = 0  # columns [0, _zeroed) are zero in every row

    def build(self, tree: DraftTree, past_length: int, padded_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """What :func:`tree_attention_inputs` returns, the mask as a view of the buffer (valid until
        the next call). With ``padded_rows`` > the root and the tree's rows, the forward runs that many
        rows: padding rows see the committed tokens and themselves, and no real row sees them."""
        parents = tree.parents.tolist()
        q = max(len(parents) + 1, padded_rows)
        rows, columns = self.mask.shape[-2:]
        if q > rows or past_length + q > columns or past_length < self._zeroed:
            self._allocate(max(q, rows), max(past_length + q, 2 * columns))
        if past_length > self._zeroed:
            self.mask[..., self._zeroed : past_length] = 0
            self._zeroed = past_length
        if len(parents) < _BITSET_ROWS:  # a round's tree: its block and positions from Python lists, few calls
            block, positions = self._small_block(parents, q, past_length)
        else:
            allowed, depths = ancestry(tree.parents)
            block = tree_block(allowed, q, self.dtype)
            positions = torch.full((1, q), past_length, dtype=torch.long)
            positions[0, : depths.numel()] += depths
        self.mask[0, 0, :q, past_length : past_length + q].copy_(block, non_blocking=True)
        return self.mask[:, :, :q, : past_length + q], positions.to(self.device, non_blocking=True)

    def _small_block(self, parents: list[int], rows: int, past_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`tree_block` and the positions of a tree of fewer than ``_BITSET_ROWS`` nodes, padded to
        ``rows``: each row's ancestors-or-self as the bits of one integer (:func:`_ancestor_bits`)."""
        seen, depths = _ancestor_bits(parents)
        seen += [1 << row for row in range(len(seen), rows)]  # padding rows see themselves alone
        depths += [0] * (rows - len(depths))
        blocked = self._blocked
        values = [0.0 if bits >> column & 1 else blocked for bits in seen for column in range(rows)]
        block = torch.tensor(values, dtype=self.dtype).view(rows, rows)
        return block, torch.tensor([[past_length + depth for depth in depths]], dtype=torch.long)


def tree_block(allowed: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive ``(rows, rows)`` mask among the forward's own rows: ``[root, tree]`` by ancestry
    (``allowed``), then padding rows up to ``rows`` that see only themselves (a row seeing nothing
    would be NaN) and that no real row sees."""
    q = allowed.shape[0]
    block = torch.full((rows, rows), torch.finfo(dtype).min, dtype=dtype)
    block[:q, :q].masked_fill_(allowed, 0)
    block.diagonal()[q:] = 0
    return block


def tree_attention_inputs(
    tree: DraftTree, past_length: int, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The 4D additive mask ``(1, 1, n + 1, past + n + 1)`` and position ids ``(1, n + 1)`` for one
    verification forward over the root and the tree on top of ``past_length`` cached tokens."""
    allowed, depths = ancestry(tree.parents)
    q = allowed.shape[0]
    mask = torch.full((1, 1, q, past_length + q), torch.finfo(dtype).min, dtype=dtype)
    mask[..., :past_length] = 0
    mask[0, 0, :, past_length:].masked_fill_(allowed, 0)
    positions = (past_length + depths)[None]
    return mask.to(device), positions.to(device)


def masks_per_layer_type(config, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
    """The verification forward's ``attention_mask`` for a model with ``config``: ``mask`` itself, or for
    a model with sliding-window layers (a cache keeping every row, see ``supports_preallocation``) one
    mask per layer type, the sliding one hiding every key ``sliding_window`` or more positions behind
    its query, as the model's own sliding masks do. ``mask`` (1, 1, q, past + q) holds the committed
    columns (column ``j`` at position ``j``) then the forward's own rows, at ``positions`` (1, q)."""
    text = config.get_text_config(decoder=True)
    if "sliding_attention" not in (getattr(text, "layer_types", None) or ()):
        return mask
    behind = outside_sliding_window(text.sliding_window, positions, mask.shape[-1] - positions.shape[-1])
    return {"full_attention": mask, "sliding_attention": mask.masked_fill(behind, torch.finfo(mask.dtype).min)}


def outside_sliding_window(window: int, positions: torch.Tensor, past: int) -> torch.Tensor:
    """(q, past + q) bool: the keys that a sliding-window layer hides from each of a forward's rows, those
    ``window`` or more positions behind it (transformers' rule: key ``k`` is seen from query ``p`` when
    ``k > p - window``). The ``past`` committed columns sit at positions ``0 .. past - 1``, then the
    forward's own rows at ``positions`` (1, q)."""
    keys = torch.cat([torch.arange(past, device=positions.device), positions[0]])
    return positions[0, :, None] - keys[None, :] >= window


def causal_mask(length: int, dtype: torch.dtype, device: torch.device | str, padding: torch.Tensor | None = None):
    """``(B or 1, 1, T, T)`` additive causal mask; ``padding`` (B, T) 1/0 also hides padded keys."""
    allowed = causal_allowed(0, length, device, padding)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)


def causal_allowed(
    begin: int, end: int, device: torch.device | str, padding: torch.Tensor | None = None
) -> torch.Tensor:
    """``(B or 1, 1, end - begin, end)`` bool: the keys before ``end`` that query rows ``begin..end`` see under
    :func:`causal_mask` (rows of it, computed without the rest)."""
    rows = torch.arange(begin, end, device=device)[:, None]
    keys = torch.arange(end, device=device)[None, :]
    allowed = (keys <= rows)[None, None]
    if padding is not None:
        allowed = allowed & padding[:, :end].bool()[:, None, None, :]
        # A padded query row with no visible key would give NaN under softmax; let it see itself.
        allowed = allowed | (keys == rows)[None, None]
    return allowed


def causal_mask_after(past: int, length: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``(1, 1, length, past + length)`` additive mask of ``length`` new rows appended to ``past`` cached
    positions: every row sees the whole cache and the new rows up to itself."""
    mask = torch.zeros(1, 1, length, past + length, dtype=dtype, device=device)
    if length > 1:  # one row sees every column: nothing to hide (a drafting round's usual catch-up)
        mask[..., past:] = causal_mask(length, dtype, device)
    return mask


def candidate_depths(parents: Sequence[int]) -> list[int]:
    """Depth of each candidate (children of the root: 1), parents listed before their children."""
    depth: list[int] = []
    for parent in parents:
        depth.append(1 if parent < 0 else depth[parent] + 1)
    return depth


def admission_order(parents: Sequence[int], scores: Sequence[float]) -> list[int]:
    """The candidates :func:`best_first_tree` takes, in the order it takes them, with no budget: by
    score (then depth, then index), each one only if its parent was taken before it. The tree for a
    budget ``N`` is exactly the first ``N`` of this order (the scan decides the same way until the
    budget runs out), which is what lets ``draftsmith tune`` read every budget from one order."""
    depth = candidate_depths(parents)
    taken: set[int] = set()
    order = []
    for i in sorted(range(len(parents)), key=lambda i: (-scores[i], depth[i], i)):
        if parents[i] < 0 or parents[i] in taken:
            taken.add(i)
            order.append(i)
    return order


def best_first_tree(
    parents: list[int], tokens: list[int], scores: list[float], budget: int
) -> tuple[DraftTree, list[int]]:
    """EAGLE-2's final re-ranking: keep the ``budget`` candidates with the highest cumulative
    log-probability, taking a node only after its parent (a child never scores above its parent, so
    this is the global top-``budget`` whenever scores are distinct). Returns the tree, ordered by
    depth so parents precede children, and the candidate index of each tree node."""
    depth = candidate_depths(parents)
    chosen = admission_order(parents, scores)[:budget]
    order = sorted(chosen, key=lambda i: (depth[i], i))
    position = {candidate: node for node, candidate in enumerate(order)}
    tree = DraftTree(
        torch.tensor([tokens[i] for i in order], dtype=torch.long),
        torch.tensor([position[parents[i]] if parents[i] >= 0 else -1 for i in order], dtype=torch.long),
    )
    return tree, order


@dataclass
class TreeGrowth:
    """The candidates of a tree being grown best-first: candidate i has a parent (-1 = the root), a
    token, a cumulative log-probability and whatever its expansion needs later (``payload``)."""

    parents: list[int]
    tokens: list[int]
    scores: list[float]
    payloads: list[object]


# expand(growth, frontier) -> per frontier candidate (-1 = the root), its children as (log p, token, payload)
Expand = Callable[[TreeGrowth, list[int]], Sequence[Sequence[tuple[float, int, object]]]]


def grow_tree(expand: Expand, depth: int, beam: int, budget: int) -> tuple[DraftTree, TreeGrowth]:
    """Best-first tree growth shared by every learned drafter: starting from the root, ``depth`` times
    expand the frontier (``expand`` proposes each frontier candidate's children), keep the ``beam``
    children with the highest cumulative log-probability as the next frontier, and finally re-rank all
    candidates into the ``budget``-node tree (:func:`best_first_tree`). EAGLE-2 uses ``beam = top_k``;
    Medusa's and the streams' Cartesian trees use ``beam = budget`` (a node of the final tree has fewer
    than ``budget`` better candidates at its depth, so nothing else can be in it)."""
    growth = TreeGrowth([], [], [], [])
    frontier = [-1]
    for _ in range(depth):
        children = []
        for parent, options in zip(frontier, expand(growth, frontier)):
            base = growth.scores[parent] if parent >= 0 else 0.0
            for logp, token, payload in options:
                children.append(len(growth.tokens))
                growth.parents.append(parent)
                growth.tokens.append(int(token))
                growth.scores.append(base + float(logp))
                growth.payloads.append(payload)
        frontier = sorted(children, key=lambda i: -growth.scores[i])[:beam]
        if not frontier:
            break
    tree, _ = best_first_tree(growth.parents, growth.tokens, growth.scores, budget)
    return tree, growth


def cartesian_tree(
    logits: torch.Tensor, top_k: int, budget: int, token_ids: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> DraftTree:
    """The best ``budget`` nodes of the tree whose depth-d nodes are the ``top_k`` tokens of row d of
    ``logits`` (levels, V) under every depth-(d - 1) node, scored by summed log-probability: Medusa's
    heads and Speculative Streaming's streams, whose guesses do not depend on the parent.
    ``token_ids`` maps logit columns to token ids (a reduced draft vocabulary)."""
    top = logits.float().log_softmax(-1).topk(min(top_k, logits.shape[-1]))
    ids = top.indices if token_ids is None else token_ids(top.indices)
    rows = [
        list(zip(values, tokens, [None] * len(tokens))) for values, tokens in zip(top.values.tolist(), ids.tolist())
    ]
    levels = iter(rows)

    def expand(growth: TreeGrowth, frontier: list[int]) -> list[list[tuple[float, int, None]]]:
        row = next(levels)
        return [row] * len(frontier)

    tree, _ = grow_tree(expand, logits.shape[0], budget, budget)
    return tree
