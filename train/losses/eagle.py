"""EAGLE / FSPAD: feature regression plus the distribution's cross-entropy."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draftsmith.core.tree import causal_mask
from draftsmith.drafters.base import FrozenTarget
from draftsmith.drafters.vocab import DraftHead
from draftsmith.train.batch import LossOutput, TrainBatch
from draftsmith.train.losses.offsets import chain_length
from draftsmith.train.soft_cross_entropy import soft_cross_entropy


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

    ``feature_noise`` perturbs the input features while training (0 turns it off). With a reduced
    draft vocabulary the CE runs over those tokens only (EAGLE-3's choice: the drafter never proposes
    anything else, and the full-vocabulary head would dominate the step's cost). The logged top-1
    accuracies compare with the target's argmax over its whole vocabulary, on at most ``metric_rows``
    supervised positions: in training only step 1's (free: it reads the step's own forward); in
    evaluation steps 1..``metric_steps``, unrolling the drafter on its own predicted features (no
    gradient; each step is one more forward over the batch, so training skips them), and
    ``sim/accept_length``, the top-1 chain length they imply."""
    inputs, next_tokens, targets, weights = _feature_pairs(batch)
    positions = torch.arange(inputs.shape[1], device=inputs.device)[None].expand(inputs.shape[0], -1)
    embeds = frozen.embed_tokens(next_tokens).to(inputs.dtype)
    noisy = inputs + _length_scaled_noise(inputs, feature_noise) if model.training and feature_noise else inputs
    mask = _padded_causal_mask(batch.attention_mask[:, 1:], inputs.dtype)
    rows = weights > 0
    # evaluation unrolls the drafter on its own features at every position; a training step reads rows only
    out = model(embeds, noisy, positions, attention_mask=mask, rows=rows if model.training else None)

    total = weights.sum().clamp_min(1.0)
    per_row = F.smooth_l1_loss(out.next_features[rows], targets[rows], reduction="none").mean(-1)
    regression = (per_row * weights[rows]).sum() / total
    head = DraftHead(frozen.lm_head, getattr(model, "module", model).draft_vocab)
    with torch.no_grad():
        teacher = head(targets[rows])
    ce = (soft_cross_entropy(head(out.token_features[rows]), teacher) * weights[rows]).sum() / total
    metrics = {"loss/smooth_l1": float(regression.detach()), "loss/ce": float(ce.detach())}
    steps = 1 if model.training else metric_steps
    if rows.any() and steps > 0:
        picked = rows.nonzero()[:metric_rows]

        def redraft(features: torch.Tensor):  # the drafter over the same tokens, reading other features
            return model(embeds, features, positions, attention_mask=mask)

        metrics.update(_draft_step_accuracy(redraft, frozen, head, inputs, out, picked, targets, steps))
    return LossOutput(regression + ce_weight * ce, metrics)


@torch.no_grad()
def _draft_step_accuracy(redraft, frozen, head, inputs, first, picked, targets, steps):
    """Top-1 agreement with the target's argmax when the drafter's inputs at earlier positions are its
    own predictions, as at draft step k, and ``1 + sum_k prod_{j<=k} acc_j``. ``redraft(features)`` runs
    the drafter over the batch's tokens reading ``features``; ``first`` is its output on ``inputs``."""
    at = (picked[:, 0], picked[:, 1])
    truth = frozen.lm_head(targets[at]).argmax(-1)
    out, accuracies = first, []
    for step in range(1, steps + 1):
        if step > 1:
            shifted = torch.cat([inputs[:, :1], out.next_features[:, :-1]], dim=1)
            out = redraft(shifted)
        accuracies.append(float((head.top1(out.token_features[at]) == truth).float().mean()))
    metrics = {f"acc/step{k}": a for k, a in enumerate(accuracies, start=1)}
    if steps > 1:
        metrics["sim/accept_length"] = chain_length(accuracies)
    return metrics


def _padded_causal_mask(padding: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return causal_mask(padding.shape[1], dtype, padding.device, padding)
