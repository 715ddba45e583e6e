"""Reduced draft vocabularies (EAGLE-3's idea): draft only among the training data's most frequent tokens.

On a small target the full-vocabulary lm_head is most of a drafter's cost per step; a drafter that
proposes only frequent tokens stays lossless, because verification never depends on what is proposed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def most_frequent_tokens(token_counts: torch.Tensor, size: int) -> torch.Tensor:
    """The ``size`` most frequent token ids of a ``(V,)`` count tensor, in ascending id order."""
    return token_counts.topk(size).indices.sort().values


def draft_vocab_maps(token_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-3's maps of a draft vocabulary (ascending target ids): ``d2t`` (N,) int64 offsets, target
    id = i + d2t[i], and ``t2d`` (vocab_size,) bool, True on drafted tokens (the layout vLLM and SGLang load)."""
    token_ids = token_ids.long().cpu()
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[token_ids] = True
    return token_ids - torch.arange(token_ids.numel()), t2d


def unused_token_id(drafted: torch.Tensor, vocab_size: int) -> int:
    """The highest token id outside ``drafted`` (the last id when every one is drafted): where an engine
    looks a placeholder's embedding up by token id, the one the drafter never proposes and the target
    rarely writes (where it does, the engine's drafter reads the placeholder for it, which can only cost
    acceptance, never change an output)."""
    taken = torch.zeros(vocab_size, dtype=torch.bool)
    taken[drafted.cpu()] = True
    outside = (~taken).nonzero().flatten()
    return int(outside[-1]) if outside.numel() else vocab_size - 1


def vocab_token_ids(vocab: torch.Tensor | None, columns: torch.Tensor) -> torch.Tensor:
    """Target token ids of output columns over ``vocab`` (None or empty = the whole vocabulary)."""
    return columns if vocab is None or not vocab.numel() else vocab[columns]


class DraftHead:
    """The target's lm_head restricted to a draft vocabulary (the whole vocabulary when ``vocab`` is
    empty). The rows are gathered once; gradients flow to the features, never to the head."""

    def __init__(self, lm_head: nn.Module, vocab: torch.Tensor) -> None:
        self.vocab = vocab.to(lm_head.weight.device) if vocab.numel() else None
        self.weight = lm_head.weight if self.vocab is None else lm_head.weight[self.vocab]
        bias = getattr(lm_head, "bias", None)
        self.bias = bias if bias is None or self.vocab is None else bias[self.vocab]
        self._linear: nn.Linear | None = None

    def __call__(self, features: torch.Tensor) -> torch.Tensor:
        if self._linear is not None and features.dtype == self.weight.dtype:
            return self._linear(features)
        return F.linear(features, self.weight.to(features.dtype), self.bias)

    def runtime_module(self) -> nn.Linear:
        """The head as a frozen ``nn.Linear`` over the same rows (made once), which every later call goes
        through: the runtime runs it through the faster kernel it gives the drafter's own linears."""
        if self._linear is None:
            out_features, in_features = self.weight.shape
            linear = nn.Linear(in_features, out_features, bias=self.bias is not None, device="meta")
            linear.weight = nn.Parameter(self.weight.detach(), requires_grad=False)
            if self.bias is not None:
                linear.bias = nn.Parameter(self.bias.detach(), requires_grad=False)
            self._linear = linear
        return self._linear

    def token_ids(self, columns: torch.Tensor) -> torch.Tensor:
        """Token ids of logit columns."""
        return vocab_token_ids(self.vocab, columns)

    def top1(self, features: torch.Tensor) -> torch.Tensor:
        return self.token_ids(self(features).argmax(-1))


def modules_with_head(model: nn.Module, head: DraftHead | Any) -> nn.Module:
    """A drafter's own modules for the runtime's kernels (:meth:`Drafter.own_modules`): ``model``, plus the
    head's linear where the head is not one of them (:meth:`DraftHead.runtime_module`)."""
    linear = head.runtime_module()
    return model if linear is None else nn.ModuleList([model, linear])
