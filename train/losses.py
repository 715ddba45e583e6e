"""Losses, one per drafter family: ``loss(model, batch, frozen, **options) -> LossOutput``.

The options are the recipe's ``loss`` section; their defaults are the published recipes' values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draftsmith.train.batch import FrozenTarget, LossOutput, TrainBatch


def _feature_pairs(batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """EAGLE's alignment: position t reads ``(f_t, x_{t+1})`` and predicts ``f_{t+1}``, whose logits
    predict ``x_{t+2}``; a position is supervised when ``x_{t+2}`` is an assistant token, so the last
    position (nothing to predict) is masked.

    Returns input features (B, T-1, h), next tokens (B, T-1), target features (B, T-1, h), weights (B, T-1)."""
    features = batch.hidden_states.float()
    weights = torch.zeros_like(batch.loss_mask[:, 1:], dtype=features.dtype)
    weights[:, :-1] = (batch.loss_mask[:, 2:] * batch.attention_mask[:, 2:]).to(features.dtype)
    return features[:, :-1], batch.input_ids[:, 1:], features[:, 1:], weights


def _length_scaled_noise(features: torch.Tensor, scale: float) -> torch.Tensor:
    """The official EAGLE noise: uniform, width ``scale * 512 / T`` (the paper states U(-0.1, 0.1))."""
    width = scale * 512 / features.shape[1]
    return (torch.rand_like(features) - 0.5) * width


def _soft_cross_entropy(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Per-row CE against the teacher's full distribution."""
    return -(teacher_logits.softmax(-1) * student_logits.log_softmax(-1)).sum(-1)


def feature_distillation_loss(
    model,
    batch: TrainBatch,
    frozen: FrozenTarget,
    ce_weight: float = 0.1,
    feature_noise: float = 0.2,
    metric_steps: int = 3,
    metric_rows: int = 128,
) -> LossOutput:
    """EAGLE / FSPAD: ``SmoothL1(f, f_target) + ce_weight * CE(lm_head(f_target) || lm_head(f~))``.

    ``feature_noise`` perturbs the input features while training (0 turns it off). ``metric_steps``
    unrolls the drafter on its own predicted features (no gradient) to log the top-1 agreement with
    the target at draft steps 1..k and the chain acceptance length they imply; ``metric_rows`` bounds
    how many supervised positions pay for ``lm_head`` in those metrics."""
    inputs, next_tokens, targets, weights = _feature_pairs(batch)
    positions = torch.arange(inputs.shape[1], device=inputs.device)[None].expand(inputs.shape[0], -1)
    embeds = frozen.embed_tokens(next_tokens).to(inputs.dtype)
    noisy = inputs + _length_scaled_noise(inputs, feature_noise) if model.training and feature_noise else inputs
    padding = batch.attention_mask[:, 1:]
    mask = _padded_causal_mask(padding, inputs.dtype)
    out = model(embeds, noisy, positions, attention_mask=mask)

    rows = weights > 0
    total = weights.sum().clamp_min(1.0)
    regression = (F.smooth_l1_loss(out.next_features, targets, reduction="none").mean(-1) * weights).sum() / total
    with torch.no_grad():
        teacher = frozen.lm_head(targets[rows])
    student = frozen.lm_head(out.token_features[rows])
    ce = (_soft_cross_entropy(student, teacher) * weights[rows]).sum() / total
    loss = regression + ce_weight * ce
    metrics = {"loss/smooth_l1": float(regression.detach()), "loss/ce": float(ce.detach())}
    if rows.any():
        metrics["acc/step1"] = float((student.argmax(-1) == teacher.argmax(-1)).float().mean())
    if metric_steps > 1 and rows.any():
        metrics.update(_unrolled_accuracy(model, frozen, embeds, inputs, out, positions, mask, rows, targets,
                                          metric_steps, metric_rows, metrics["acc/step1"]))
    return LossOutput(loss, metrics)


@torch.no_grad()
def _unrolled_accuracy(model, frozen, embeds, inputs, first, positions, mask, rows, targets, steps, max_rows, acc1):
    """Top-1 agreement when the drafter's inputs at earlier positions are its own predictions, as at
    draft step k, and ``1 + sum_k prod_{j<=k} acc_j``: the acceptance length of a top-1 chain."""
    picked = rows.nonzero()[:max_rows]
    teacher = frozen.lm_head(targets[picked[:, 0], picked[:, 1]]).argmax(-1)
    accuracies, predicted = [acc1], first.next_features
    for step in range(2, steps + 1):
        shifted = torch.cat([inputs[:, :1], predicted[:, :-1]], dim=1)
        out = model(embeds, shifted, positions, attention_mask=mask)
        tokens = frozen.lm_head(out.token_features[picked[:, 0], picked[:, 1]]).argmax(-1)
        accuracies.append(float((tokens == teacher).float().mean()))
        predicted = out.next_features
    metrics = {f"acc/step{k}": a for k, a in enumerate(accuracies, start=1) if k > 1}
    chain, product = 1.0, 1.0
    for accuracy in accuracies:
        product *= accuracy
        chain += product
    metrics["sim/accept_length"] = chain
    return metrics


def _padded_causal_mask(padding: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    from draftsmith.drafters.eagle import causal_mask

    return causal_mask(padding.shape[1], dtype, padding.device, padding)
