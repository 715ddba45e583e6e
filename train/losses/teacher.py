"""The target's distribution over the draft vocabulary at the positions that teach (EAGLE-3, P-EAGLE, DFlash)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.drafters.base import FrozenTarget
from draftsmith.drafters.vocab import DraftHead
from draftsmith.train.batch import TrainBatch
from draftsmith.train.losses.offsets import shift_left


@dataclass
class DraftVocabTeacher:
    """The target's distribution at the positions that teach a supervised token: ``logits`` (n, N) over
    the draft vocabulary, one row per needed position in row-major order, ``row`` (B, T) the row of each
    position (-1 where not needed), and ``argmax`` (B, T) its top token over the whole vocabulary (0
    where not needed). Compact because a dense (B, T, N) tensor would be the step's largest."""

    logits: torch.Tensor
    row: torch.Tensor
    argmax: torch.Tensor

    def rows(self, where: torch.Tensor, shift: int) -> torch.Tensor:
        """The indices of the logits rows read ``shift`` positions ahead of each True position of ``where``
        (B, T)."""
        return shift_left(self.row, shift)[where]


@torch.no_grad()
def draft_vocab_teacher(
    frozen: FrozenTarget, core, batch: TrainBatch, needed: torch.Tensor, chunk_rows: int
) -> DraftVocabTeacher:
    """The teacher at the ``needed`` (B, T) positions only: ``chunk_rows`` rows of full-vocabulary
    logits at a time (0 = all at once). Where the batch carries the target's greedy tokens (a feature
    cache keeps them), only the draft vocabulary's columns are computed."""
    features = batch.hidden_states.float()
    rows = features[needed]
    vocab = core.draft_token_ids()
    size = chunk_rows if chunk_rows > 0 else max(rows.shape[0], 1)
    parts, tops = [features.new_zeros(0, vocab.numel())], [torch.zeros(0, dtype=torch.long, device=features.device)]
    whole = vocab.numel() == frozen.lm_head.weight.shape[0]  # ascending ids: every token, so no rows to gather
    head = DraftHead(frozen.lm_head, vocab[:0] if whole else vocab) if batch.target_argmax is not None else None
    for start in range(0, rows.shape[0], size):
        if head is not None:
            parts.append(head(rows[start : start + size]).float())
            continue
        logits = frozen.lm_head(rows[start : start + size]).float()
        parts.append(logits[:, vocab])
        tops.append(logits.argmax(-1))
    row = torch.full(needed.shape, -1, dtype=torch.long, device=features.device)
    row[needed] = torch.arange(rows.shape[0], device=features.device)
    argmax = torch.zeros(needed.shape, dtype=torch.long, device=features.device)
    argmax[needed] = torch.cat(tops) if head is None else batch.target_argmax[needed]
    return DraftVocabTeacher(torch.cat(parts), row, argmax)
