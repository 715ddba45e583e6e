"""What the generic trainer hands a drafter family's loss: one batch (and the frozen target parts,
:class:`~draftsmith.drafters.base.FrozenTarget`).

Every family's loss has the signature ``loss(model, batch, frozen, **options) -> LossOutput``; the
``options`` are the recipe's ``loss`` section, so a misspelt option is a TypeError caught as a recipe
error before training starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class TrainBatch:
    """Right-padded token sequences with the target's features.

    ``hidden_states`` is the feature ``f_t`` = the input of the target's ``lm_head`` at every position
    (``outputs.hidden_states[-1]``), read from the feature cache (offline) or computed in the step
    with the frozen target (online); float32 on the model's device. ``drafter_states`` are the target
    states the drafter reads (its config's ``feature_layers()``, concatenated): the same tensor as
    ``hidden_states`` for drafters that read the feature alone."""

    input_ids: torch.Tensor  # (B, T) long
    loss_mask: torch.Tensor  # (B, T) float: 1 on supervised (assistant) tokens
    attention_mask: torch.Tensor  # (B, T) long: 1 on real tokens, 0 on padding
    hidden_states: torch.Tensor | None = None  # (B, T, h)
    drafter_states: torch.Tensor | None = None  # (B, T, layers x h)
    target_argmax: torch.Tensor | None = None  # (B, T) long: the target's greedy token, where the cache holds it

    def to(self, device: torch.device | str) -> TrainBatch:
        hidden = None if self.hidden_states is None else self.hidden_states.to(device)
        states = self.drafter_states
        if states is not None:
            states = hidden if states is self.hidden_states else states.to(device)
        return TrainBatch(
            *(t.to(device) if t is not None else None for t in (self.input_ids, self.loss_mask, self.attention_mask)),
            hidden_states=hidden,
            drafter_states=states,
            target_argmax=None if self.target_argmax is None else self.target_argmax.to(device),
        )


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, differentiable
    metrics: dict[str, float] = field(default_factory=dict)  # detached figures to log (loss terms, accuracies)
