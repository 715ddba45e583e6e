"""Prompt lookup (n-gram) decoding: propose what followed the last n-gram earlier in the context."""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.core.drafting import DraftContext, Drafter
from draftsmith.core.tree import DraftTree


@dataclass
class PromptLookupDrafter(Drafter):
    """Match the last ``n`` tokens (``max_ngram`` down to ``min_ngram``) against the earlier context and
    propose the ``num_draft`` tokens that followed the most recent match; no match gives an empty tree
    (a plain decoding step)."""

    max_ngram: int = 3
    min_ngram: int = 1
    num_draft: int = 10
    name: str = "pld"

    def propose(self, context: DraftContext) -> DraftTree:
        tokens = context.tokens
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            pattern = tokens[-n:]
            # most recent earlier occurrence whose continuation is non-empty
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start : start + n] == pattern:
                    return DraftTree.chain(tokens[start + n : start + n + self.num_draft])
        return DraftTree.empty()
