"""Lossless verification of a draft tree against the target's logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.core.tree import DraftTree


@dataclass
class Verdict:
    accepted_nodes: list[int]  # tree node indices along the accepted path, root to leaf
    next_token: int  # the target's own token after the accepted path (bonus or correction)


def verify_greedy(tree: DraftTree, logits: torch.Tensor) -> Verdict:
    """Accept the longest path whose every token equals the target's argmax at its parent.

    ``logits`` is ``(n + 1, V)`` over ``[root, nodes]``. The result is exactly what greedy decoding
    would produce: each accepted token is the argmax given everything before it."""
    return verify_greedy_tokens(tree, logits.argmax(dim=-1))


def verify_greedy_tokens(tree: DraftTree, predictions: torch.Tensor | list[int]) -> Verdict:
    """:func:`verify_greedy` from the target's argmax at ``[root, nodes]`` (``(n + 1,)`` token ids)."""
    predictions = predictions.tolist() if isinstance(predictions, torch.Tensor) else predictions
    tokens = tree.tokens.tolist()
    accepted, current = [], -1
    while True:
        wanted = predictions[current + 1]
        match = next((i for i in tree.children(current) if tokens[i] == wanted), None)
        if match is None:
            return Verdict(accepted, wanted)
        accepted.append(match)
        current = match


@dataclass(frozen=True)
class SamplingConfig:
    """The same processing plain sampling applies: temperature, then top-k, then top-p."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Target distribution(s) over the vocabulary from raw logits (..., V), in float32."""
        scores = logits.float() / self.temperature
        if self.top_k and self.top_k < scores.shape[-1]:
            kth = scores.topk(self.top_k, dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_scores, order = scores.sort(dim=-1, descending=True)
            cumulative = sorted_scores.softmax(-1).cumsum(-1)
            # drop a token when the mass before it already reaches top_p (the first token always stays)
            drop_sorted = (cumulative - sorted_scores.softmax(-1)) >= self.top_p
            drop = drop_sorted.scatter(-1, order, drop_sorted)
            scores = scores.masked_fill(drop, float("-inf"))
        return scores.softmax(-1)


def sample(p: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from the distribution ``p`` (need not be normalised)."""
    return int(torch.multinomial(p, 1, generator=generator))


def _uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand((), generator=generator))


def verify_sampling(
    tree: DraftTree, logits: torch.Tensor, config: SamplingConfig, generator: torch.Generator | None = None
) -> Verdict:
    """Lossless sampling verification; every committed token is distributed exactly as plain sampling.

    A node drafted by sampling from a known distribution ``q`` (``tree.draft_dists``, a sampled chain)
    uses Leviathan's rule: accept ``x`` with probability ``min(1, p(x)/q(x))``, on rejection sample
    from ``norm(max(0, p - q))``. Deterministic drafts (no ``q``) use recursive rejection over distinct
    siblings: accept ``x`` with probability ``p(x)``; on rejection set ``p(x) = 0``, renormalise and try
    the next sibling; if none is accepted, sample from what is left."""
    probs = config.probs(logits)
    tokens = tree.tokens.tolist()
    accepted, current = [], -1
    while True:
        p = probs[current + 1].clone()
        children = tree.children(current)
        if tree.draft_dists is not None and children:
            if len(children) != 1:
                raise ValueError("sampled drafts (with draft_dists) must be chains")
            chosen, p = _leviathan(p, tree.draft_dists[children[0]].float(), tokens[children[0]], generator)
            chosen = children[0] if chosen else None
        else:
            chosen = _recursive_rejection(p, [(c, tokens[c]) for c in children], generator)
        if chosen is None:
            return Verdict(accepted, sample(p, generator))
        accepted.append(chosen)
        current = chosen


def _leviathan(p: torch.Tensor, q: torch.Tensor, token: int, generator) -> tuple[bool, torch.Tensor]:
    """(accepted, distribution to sample from on rejection)."""
    if _uniform(generator) < min(1.0, float(p[token]) / max(float(q[token]), 1e-30)):
        return True, p
    residual = (p - q).clamp_min(0)
    return False, residual if float(residual.sum()) > 0 else p


def _recursive_rejection(p: torch.Tensor, children: list[tuple[int, int]], generator) -> int | None:
    """Walk distinct sibling tokens; ``p`` is zeroed in place at each rejected token."""
    seen = set()
    for child, token in children:
        if token in seen:
            continue
        seen.add(token)
        mass = float(p.sum())
        if mass > 0 and _uniform(generator) < float(p[token]) / mass:
            return child
        p[token] = 0.0
    return None
