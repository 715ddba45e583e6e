"""How ``draftsmith tune`` searches a family's trees: the candidate trees it tries, how deep they go and
how their acceptance is read. A family declares its search in the registry (:attr:`Family.tree_search`);
tune asks it, so a family with a new kind of tree adds a search here, not a branch in tune."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from draftsmith.drafters.base import DrafterConfig, TreeOptions
from draftsmith.drafters.medusa import DYNAMIC


@dataclass(frozen=True)
class Shape:
    depth: int
    top_k: int
    total_tokens: int
    medusa: bool = False  # Medusa's dynamic tree: depth (heads that run) follows from the budget, not an option
    lookup: int = 0  # a prompt-lookup chain of up to this many tokens grafted onto each tree (lookup=N)

    def options(self) -> TreeOptions:
        if self.medusa:
            return TreeOptions(tree=DYNAMIC, top_k=self.top_k, total_tokens=self.total_tokens)
        return TreeOptions(depth=self.depth, top_k=self.top_k, total_tokens=self.total_tokens)

    def entry(self) -> dict[str, Any]:
        """The tree options as ``tuned_trees.json`` and serve-time options name them."""
        options = self.options()
        names = sorted(TreeOptions.names(), key=lambda name: name != "tree")  # Medusa's mode reads first
        entry = {name: getattr(options, name) for name in names if getattr(options, name) is not None}
        return entry | ({"lookup": self.lookup} if self.lookup else {})

    def text(self) -> str:
        return " ".join(f"{name}={value}" for name, value in self.entry().items())


@dataclass(frozen=True)
class SearchGrid:
    """What ``draftsmith tune`` is asked to try: ``--max-depth``, ``--top-k``, ``--total-tokens`` and
    ``--lookup`` (prompt-lookup chain lengths to graft; 0 none)."""

    max_depth: int
    top_ks: Sequence[int]
    totals: Sequence[int]
    lookups: Sequence[int] = (0,)


class TreeSearch:
    """A family's tree search. ``reads_growth``: every tree's acceptance is read off one growth of the
    largest tree per top_k (EAGLE-2's best-first growth, :meth:`grow` of its runtime drafter); otherwise
    every candidate tree is drafted at every position and its acceptance counted. ``grafts_lookup``: its
    trees are also tried with prompt lookup's chain grafted on."""

    reads_growth = False
    grafts_lookup = False

    def deepest(self, config: DrafterConfig, max_depth: int) -> int:
        """The deepest tree it tries, given ``--max-depth``."""
        raise NotImplementedError

    def candidates(self, config: DrafterConfig, grid: SearchGrid) -> list[Shape]:
        """The trees it tries."""
        raise NotImplementedError

    def recorded(self, config: DrafterConfig, grid: SearchGrid) -> dict[str, Any]:
        """The search as ``tuned_trees.json`` records it."""
        raise NotImplementedError


class GrowthSearch(TreeSearch):
    """EAGLE-2's best-first growth from the drafter's features: depth, top_k, total_tokens (and lookup)."""

    reads_growth = True
    grafts_lookup = True

    def deepest(self, config: DrafterConfig, max_depth: int) -> int:
        return max_depth

    def candidates(self, config: DrafterConfig, grid: SearchGrid) -> list[Shape]:
        return search_space(grid.max_depth, grid.top_ks, grid.totals, grid.lookups)

    def recorded(self, config: DrafterConfig, grid: SearchGrid) -> dict[str, Any]:
        return {
            "max_depth": grid.max_depth,
            "top_k": list(grid.top_ks),
            "total_tokens": list(grid.totals),
            "lookup": list(grid.lookups),
        }


class HeadsSearch(TreeSearch):
    """Medusa's dynamic tree over its heads' candidates: top_k per head, total_tokens; a tree is as deep
    as the heads (``--max-depth`` does not apply)."""

    def deepest(self, config: DrafterConfig, max_depth: int) -> int:
        return config.num_heads

    def candidates(self, config: DrafterConfig, grid: SearchGrid) -> list[Shape]:
        return medusa_search_space(config.num_heads, grid.top_ks, grid.totals)

    def recorded(self, config: DrafterConfig, grid: SearchGrid) -> dict[str, Any]:
        return {"heads": config.num_heads, "top_k": list(grid.top_ks), "total_tokens": list(grid.totals)}


class ParallelSearch(TreeSearch):
    """One forward drafts every depth (P-EAGLE, DFlash): depth, top_k per depth, total_tokens; the depths
    that forward was trained to draft bound the tree."""

    def deepest(self, config: DrafterConfig, max_depth: int) -> int:
        return min(max_depth, config.parallel_depths())

    def candidates(self, config: DrafterConfig, grid: SearchGrid) -> list[Shape]:
        return parallel_search_space(self.deepest(config, grid.max_depth), grid.top_ks, grid.totals)

    def recorded(self, config: DrafterConfig, grid: SearchGrid) -> dict[str, Any]:
        depth = self.deepest(config, grid.max_depth)
        return {"max_depth": depth, "top_k": list(grid.top_ks), "total_tokens": list(grid.totals)}


def candidate_count(depth: int, top_k: int) -> int:
    """Candidates an EAGLE-2 growth makes: the root's top_k children, then top_k children for each of
    the top_k frontier nodes at every further level."""
    return top_k + (depth - 1) * top_k * top_k


def search_space(
    max_depth: int, top_ks: Sequence[int], totals: Sequence[int], lookups: Sequence[int] = (0,)
) -> list[Shape]:
    """Every (depth, top_k, total_tokens) whose budget the growth can fill (a larger budget would
    verify the same tree), with each prompt-lookup chain length in ``lookups``."""
    return [
        Shape(depth, top_k, total, lookup=lookup)
        for lookup in lookups
        for top_k in top_ks
        for depth in range(1, max_depth + 1)
        for total in totals
        if total <= candidate_count(depth, top_k)
    ]


def medusa_search_space(heads: int, top_ks: Sequence[int], totals: Sequence[int]) -> list[Shape]:
    """Every dynamic Medusa tree (top_k per head, total_tokens) whose budget the heads can fill."""
    return [
        Shape(min(heads, total), top_k, total, medusa=True)  # a budget of N nodes reaches depth N at most
        for top_k in top_ks
        for total in totals
        if total <= sum(top_k**depth for depth in range(1, heads + 1))
    ]


def parallel_search_space(max_depth: int, top_ks: Sequence[int], totals: Sequence[int]) -> list[Shape]:
    """Every tree of one forward's depths (depth, top_k per depth, total_tokens) whose budget the
    depths can fill and reach: a budget of N nodes never drafts deeper than N."""
    return [
        Shape(depth, top_k, total)
        for top_k in top_ks
        for depth in range(1, max_depth + 1)
        for total in totals
        if depth <= total <= sum(top_k**level for level in range(1, depth + 1))
    ]
