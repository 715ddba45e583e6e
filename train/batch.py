"""What the generic trainer hands a drafter family's loss: one batch and the frozen target parts.

Every family's loss has the signature ``loss(model, batch, frozen, **options) -> LossOutput``; the
``options`` are the recipe's ``loss`` section, so a misspelt option is a TypeError caught as a recipe
error before training starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class TrainBatch:
    """Right-padded token sequences with the target's features.

    ``hidden_states`` is the feature ``f_t`` = the input of the target's ``lm_head`` at every position
    (``outputs.hidden_states[-1]``), read from the feature cache (offline) or computed in the step
    with the frozen target (online); float32 on the model's device."""

    input_ids: torch.Tensor  # (B, T) long
    loss_mask: torch.Tensor  # (B, T) float: 1 on supervised (assistant) tokens
    attention_mask: torch.Tensor  # (B, T) long: 1 on real tokens, 0 on padding
    hidden_states: torch.Tensor | None = None  # (B, T, h)

    def to(self, device: torch.device | str) -> TrainBatch:
        return TrainBatch(
            *(t.to(device) if t is not None else None for t in (self.input_ids, self.loss_mask, self.attention_mask)),
            hidden_states=None if self.hidden_states is None else self.hidden_states.to(device),
        )


@dataclass
class FrozenTarget:
    """The target's token embedding and ``lm_head``: used by drafters, never trained, never saved in
    a drafter checkpoint (the checkpoint records the target's identity instead)."""

    embed_tokens: nn.Module
    lm_head: nn.Module

    @classmethod
    def from_model(cls, model: nn.Module) -> FrozenTarget:
        embed, head = model.get_input_embeddings(), model.get_output_embeddings()
        for module in (embed, head):
            module.requires_grad_(False)
        return cls(embed, head)


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, differentiable
    metrics: dict[str, float] = field(default_factory=dict)  # detached figures to log (loss terms, accuracies)
