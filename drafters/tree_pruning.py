"""Speculative Streaming's parallel tree pruning (Bhendawade et al. 2024, §3.2.3 and appendix A).

Inside the verification forward, after the draft tree has passed the first ``L - Ns`` layers, an
early exit estimates each node's probability given its parent; nodes under a threshold are dropped
with their whole sub-tree before the streams are inserted, so the top ``Ns`` layers (main stream
and streams) run over fewer rows. Dropping draft nodes never changes what the kept rows compute
(a row attends only to its ancestors, and a kept row's ancestors are all kept), so decoding stays
lossless.

What the paper fixes, and is followed here:
- early-exit logits ``z~ = H(o_θ(M^l))``: ``o_θ`` a low-rank linear map (rank θ = 8), ``H`` the
  target's original lm_head, ``M^l`` the main stream at ``l = L - Ns`` (just before stream insertion);
- ``softmax(z~_p)[c]`` approximates the transition from parent ``p`` to child ``c``; a child under the
  threshold is pruned together with its sub-tree;
- the adapter trains on next-token loss, jointly with the streams or after them.

What is chosen here (the first item departs from the paper's letter by default; the rest it leaves open):
- ``o_θ(M) = N(M) + B(A(N(M)))`` by default (``pruning_exit: lens``), ``N`` the target's final norm,
  ``B = 0`` at first: the adapter starts as the target's own logit lens at layer ``l`` and learns a
  low-rank correction. On SmolLM2 that lens agrees with the final greedy token on 45% of assistant
  positions at Ns 4 (54% at Ns 2, 27% at Ns 8). The paper's literal ``o_θ(M) = B(A(M))``
  (``pruning_exit: linear``; no residual, no norm) starts uniform (so an untrained one with a
  threshold above 1/V prunes all) and, fed the un-normalised ``M`` (RMS ~200 from a few massive
  dimensions), reached 1-7% top-1 accuracy in 8-24 training steps;
- the root (the last committed token, not a draft) is never pruned; a threshold of 0 prunes nothing;
- the keys/values the pruned rows left in layers ``< L - Ns`` are dropped right after the forward
  (the paper trims them lazily), so every layer's cache holds the same rows for the runtime's commit;
- the adapter reads a detached ``M^l``: its loss trains the adapter only, never the LoRA or the
  layers below, so adding it (jointly or afterwards) leaves the served model as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


def build_pruning_adapter(hidden_size: int, rank: int) -> nn.Sequential:
    """``o_θ``: hidden -> rank -> hidden, no bias; the second map starts at 0."""
    adapter = nn.Sequential(nn.Linear(hidden_size, rank, bias=False), nn.Linear(rank, hidden_size, bias=False))
    nn.init.zeros_(adapter[1].weight)
    return adapter


@dataclass
class TreePruning:
    """What one pruned forward needs: the tree's shape, its tokens and the threshold."""

    parents: list[int]  # parent row of each row of [root, nodes]; -1 for the root
    input_ids: torch.Tensor  # (q,) token of each row
    past: int  # cached tokens before the root
    threshold: float

    @classmethod
    def from_mask(cls, allowed: torch.Tensor, input_ids: torch.Tensor, past: int, threshold: float) -> TreePruning:
        """From the forward's own inputs: ``allowed`` (q, past + q) bool is the tree mask (row i sees
        its ancestors and itself), ``input_ids`` (q,)."""
        return cls(tree_parents(allowed[:, past:]).tolist(), input_ids, past, threshold)


def tree_parents(allowed: torch.Tensor) -> torch.Tensor:
    """(q,) parent row of each row from the (q, q) ancestor-or-self mask over [root, nodes]; -1 for the
    root. Rows are in topological order, so the parent is the ancestor with the largest index."""
    rows = torch.arange(allowed.shape[0], device=allowed.device)
    earlier = allowed.bool() & (rows[None, :] < rows[:, None])
    return torch.where(earlier, rows[None, :], -1).max(dim=1).values


@torch.no_grad()
def transition_probabilities(early_exit_logits: Any, hidden: torch.Tensor, pruning: TreePruning) -> torch.Tensor:
    """(q,) estimated probability of each row's token given its parent row: the softmax of the
    parent's early-exit logits (``early_exit_logits(hidden) -> logits``) at that token; 1 for the root.
    ``hidden`` (q, h) is the main stream at layer L - Ns. Only parent rows go through the lm_head."""
    parents = torch.tensor(pruning.parents, device=hidden.device).clamp_min(0)
    unique, inverse = parents.unique(return_inverse=True)
    logprobs = early_exit_logits(hidden[unique]).float().log_softmax(-1)  # (P, V)
    probs = logprobs[inverse, pruning.input_ids.to(hidden.device)].exp()
    probs[0] = 1.0
    return probs


def surviving_rows(probs: torch.Tensor, parents: list[int], threshold: float) -> list[int]:
    """The root and every node whose own estimate and all its ancestors' are >= ``threshold``."""
    kept = [True]
    for row, value in enumerate(probs.tolist()[1:], start=1):
        kept.append(kept[parents[row]] and value >= threshold)
    return [row for row, keep in enumerate(kept) if keep]


def kept_columns(rows: torch.Tensor, past: int) -> torch.Tensor:
    """Key positions left after pruning: the cached prefix and the kept rows of this forward."""
    return torch.cat([torch.arange(past, device=rows.device), past + rows])


def select_rows(
    args: tuple, kwargs: dict[str, Any], rows: torch.Tensor, past: int, hidden_too: bool
) -> tuple[tuple, dict[str, Any]]:
    """A decoder layer's inputs restricted to ``rows`` of the forward (batch 1): the 4D mask (the rows,
    and the columns of the cached prefix and of the rows), RoPE's cos / sin, the position ids and, with
    ``hidden_too`` (the first pruned layer; later ones get their predecessor's pruned output), the
    hidden states. HF hands every layer the full mask and tables, so each pruned layer needs this."""
    kwargs = dict(kwargs)
    kwargs["attention_mask"] = kwargs["attention_mask"][:, :, rows][..., kept_columns(rows, past)]
    kwargs["position_embeddings"] = tuple(t[:, rows] for t in kwargs["position_embeddings"])
    if kwargs.get("position_ids") is not None:
        kwargs["position_ids"] = kwargs["position_ids"][:, rows]
    if hidden_too and args:
        args = (args[0][:, rows], *args[1:])
    elif hidden_too:
        kwargs["hidden_states"] = kwargs["hidden_states"][:, rows]
    return args, kwargs
