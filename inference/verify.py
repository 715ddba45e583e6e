"""Lossless verification of a draft tree against the target's logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.inference.tree import DraftTree


@dataclass
class Verdict:
    accepted_nodes: list[int]  # tree node indices along the accepted path, root to leaf
    next_token: int  # the target's own token after the accepted path (bonus or correction)


def verify_greedy(tree: DraftTree, logits: torch.Tensor) -> Verdict:
    """Accept the longest path whose every token equals the target's argmax at its parent.

    ``logits`` is ``(n + 1, V)`` over ``[root, nodes]``. The result is exactly what greedy decoding
    would produce: each accepted token is the argmax given everything before it."""
    predictions = logits.argmax(dim=-1).tolist()
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    accepted, current = [], -1
    while True:
        wanted = predictions[current + 1]
        match = next((i for i, p in enumerate(parents) if p == current and tokens[i] == wanted), None)
        if match is None:
            return Verdict(accepted, wanted)
        accepted.append(match)
        current = match
