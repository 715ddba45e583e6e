"""Medusa-2: the heads with a LoRA on the target, kept close to the original by self-distillation."""

from __future__ import annotations

from draftsmith.drafters.base import FrozenTarget
from draftsmith.train.batch import LossOutput, TrainBatch
from draftsmith.train.losses.chunked import distillation_metrics, next_token_terms
from draftsmith.train.losses.medusa import medusa_head_rows, medusa_heads_ce


def medusa2_loss(
    model,
    batch: TrainBatch,
    frozen: FrozenTarget,
    kl_weight: float = 1.0,
    head_weight: float = 0.2,
    decay: float = 0.8,
    soft_labels: bool = False,
    logit_chunk_rows: int = 1024,
) -> LossOutput:
    """Medusa-2: ``kl_weight * KL(original || adapted) + head_weight * sum_k decay^k * CE_k``.

    The LoRA-adapted target and the heads train together: the heads read the adapted model's features,
    so their CE also trains the LoRA. The KL is self-distillation against the same target with the
    adapters off, at the positions whose next token is an assistant token; with self-distilled data
    (the target's own answers) it is what keeps the served model's quality. The heads are supervised
    as in :func:`medusa_loss`; ``soft_labels`` takes the adapted model's distribution (the one
    verification compares against) as their teacher. The KL's full-vocabulary logits (adapted and
    original) are made ``logit_chunk_rows`` rows at a time (see :func:`chunked_terms`).

    Metrics: :func:`medusa_loss`'s, plus ``loss/kl``, ``loss/heads`` and ``agree/original`` (how often
    the adapted model's argmax is the original's at those positions)."""
    core = getattr(model, "module", model)  # DDP / DeepSpeed wrap the model; compute still goes through model()
    rows = medusa_head_rows(batch, int(core.config.num_heads))
    out = model(batch.input_ids, attention_mask=batch.attention_mask, head_rows=rows, logits=False)
    features = out.features.float()
    heads, metrics = medusa_heads_ce(core.heads, batch, features, rows, out.head_logits, frozen, decay, soft_labels)
    predicting = (batch.loss_mask * batch.attention_mask).bool()[:, 1:]  # x_{t+1} is an assistant token
    terms = next_token_terms(core, out, batch.input_ids, predicting, logit_chunk_rows)
    metrics.update({**distillation_metrics(terms), "loss/heads": float(heads.detach())})
    return LossOutput(kl_weight * terms.kl + head_weight * heads, metrics)
