"""Medusa-1: each head's cross-entropy at its offset, the target frozen."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draftsmith.drafters.base import FrozenTarget
from draftsmith.drafters.vocab import DraftHead
from draftsmith.train.batch import LossOutput, TrainBatch
from draftsmith.train.losses.offsets import per_offset_ce
from draftsmith.train.soft_cross_entropy import soft_cross_entropy


def medusa_loss(
    model,
    batch: TrainBatch,
    frozen: FrozenTarget,
    decay: float = 0.8,
    soft_labels: bool = False,
) -> LossOutput:
    """Medusa-1: ``sum_k decay^k * CE_k`` (k = 1..K) over assistant tokens, the target frozen.

    Head k at position t reads ``f_t`` and is supervised on ``x_{t+k+1}`` where that token is an
    assistant token (hard labels), or on the target's own distribution for it,
    ``softmax(lm_head(f_{t+k}))`` (``soft_labels``: self-distillation; needs no regenerated data).
    With a draft vocabulary, hard labels outside it are left out of the CE (a head cannot name them)
    and soft labels are the target's distribution restricted to it.

    Metrics: ``acc/head{k}`` = top-1 agreement with ``x_{t+k+1}`` (a token outside the draft vocabulary
    counts as a miss), and ``sim/accept_length`` = 1 + the mean number of leading heads that are all
    right at a position: the acceptance length of a top-1 chain on this data."""
    core = getattr(model, "module", model)  # DDP / DeepSpeed wrap the heads; compute still goes through model()
    features = batch.hidden_states.float()
    rows = medusa_head_rows(batch, int(core.config.num_heads))
    logits = model([features[:, : mask.shape[1]][mask] for mask in rows])  # head k: (N_k, V')
    return LossOutput(*medusa_heads_ce(core, batch, features, rows, logits, frozen, decay, soft_labels))


def medusa_head_rows(batch: TrainBatch, heads: int) -> list[torch.Tensor]:
    """Head k (1-based) at t predicts ``x_{t+k+1}``, so it has a label for t < T - k - 1: ``rows[k - 1]``
    (B, span_k = max(T - k - 1, 0)) says where that label is an assistant token. Head k reads the
    features ``features[:, :span_k][rows[k - 1]]``."""
    supervised = (batch.loss_mask * batch.attention_mask).bool()
    return [supervised[:, k + 1 :] for k in range(1, heads + 1)]


def medusa_heads_ce(
    core, batch: TrainBatch, features: torch.Tensor, rows: list[torch.Tensor], logits, frozen, decay, soft_labels
) -> tuple[torch.Tensor, dict[str, float]]:
    """``sum_k decay^k * CE_k`` and its metrics (see :func:`medusa_loss`) from each head's logits at its
    rows; ``core`` is the ``MedusaHeads``, ``features`` (B, T, h) float what they read."""
    vocab_index = core.vocab_index(core.config.vocab_size)

    def head_ce(k: int, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        head_logits, labels = logits[k - 1], batch.input_ids[:, k + 1 :][mask]
        columns = labels if vocab_index is None else vocab_index[labels]
        if soft_labels:
            ce = _medusa_soft_ce(head_logits, features[:, k : k + mask.shape[1]][mask], frozen, core)
        else:
            known = columns >= 0
            ce = F.cross_entropy(head_logits[known], columns[known]) if known.any() else head_logits.sum() * 0.0
        return ce, head_logits.detach().argmax(-1) == columns

    ces, metrics = per_offset_ce(batch, len(rows), head_ce, "head")
    return sum(decay**k * ce for k, ce in enumerate(ces, start=1)), metrics


def _medusa_soft_ce(head_logits: torch.Tensor, teacher_features: torch.Tensor, frozen: FrozenTarget, core):
    """CE against the target's distribution at the label position (over the draft vocabulary if any)."""
    if head_logits.shape[0] == 0:
        return head_logits.sum() * 0.0
    with torch.no_grad():
        teacher = DraftHead(frozen.lm_head, core.draft_vocab)(teacher_features)
    return soft_cross_entropy(head_logits, teacher).mean()  # it reads both in float32, a few rows at a time
