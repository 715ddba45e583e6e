"""Prompt lookup (n-gram) decoding: propose what followed the last n-gram earlier in the context."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.core.drafting import DraftContext, Drafter
from draftsmith.core.tree import DraftTree

# Draft length by where the target verifies. On a CPU a verification forward's cost grows with its rows,
# and a prompt-lookup chain is mostly rejected after its first tokens, so a short chain decodes faster
# there (the measured comparison is in the benchmark notes); on a GPU extra rows are nearly free.
CPU_NUM_DRAFT = 3
GPU_NUM_DRAFT = 10


def default_num_draft(device: torch.device) -> int:
    return CPU_NUM_DRAFT if device.type == "cpu" else GPU_NUM_DRAFT


@dataclass
class PromptLookupDrafter(Drafter):
    """Match the last ``n`` tokens (``max_ngram`` down to ``min_ngram``) against the earlier context and
    propose the ``num_draft`` tokens that followed the most recent match; no match gives an empty tree
    (a plain decoding step). ``methods.build_drafter`` makes one from ``pld:num_draft=N:max_ngram=M``."""

    max_ngram: int = 3
    min_ngram: int = 1
    num_draft: int = 10
    name: str = "pld"

    def propose(self, context: DraftContext) -> DraftTree:
        tokens = context.tokens
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            pattern = tokens[-n:]
            # most recent earlier occurrence whose continuation is non-empty (its first token compared
            # before a slice is made: this runs every round, over the whole context where nothing matches)
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start] == pattern[0] and tokens[start : start + n] == pattern:
                    return DraftTree.chain(tokens[start + n : start + n + self.num_draft])
        return DraftTree.empty()
