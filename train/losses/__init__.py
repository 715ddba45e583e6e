"""Losses, one module per drafter family: ``loss(model, batch, frozen, **options) -> LossOutput``.

The options are the recipe's ``loss`` section; their defaults are the published recipes' values. A
family's registry entry names its loss (:attr:`~draftsmith.drafters.registry.Family.loss`), and
:data:`LOSSES` below holds every loss under that name: ``drafters/`` cannot import training code (decoding
never loads it), so training attaches the losses here, in one explicit table. Shared pieces have modules
of their own: the training-time-test unroll (``ttt``), the target's draft-vocabulary teacher
(``teacher``), full-vocabulary CE and KL made a chunk of rows at a time (``chunked``), per-offset terms
(``offsets``) and options as dataclasses (``options``).
"""

from __future__ import annotations

from typing import Any

from draftsmith.drafters.registry import Family
from draftsmith.train.losses.dflash import dflash_loss
from draftsmith.train.losses.eagle import feature_distillation_loss
from draftsmith.train.losses.eagle3 import eagle3_loss
from draftsmith.train.losses.medusa import medusa_loss
from draftsmith.train.losses.medusa2 import medusa2_loss
from draftsmith.train.losses.options import LossFn, check_options, option_defaults
from draftsmith.train.losses.peagle import peagle_loss
from draftsmith.train.losses.streaming import streaming_loss
from draftsmith.train.recipe_loader import RecipeError

# Every family's loss, under the name its registry entry gives (``Family.loss``).
LOSSES: dict[str, LossFn] = {
    "feature_distillation_loss": feature_distillation_loss,  # eagle, fspad
    "eagle3_loss": eagle3_loss,  # eagle3, fspad3
    "peagle_loss": peagle_loss,
    "dflash_loss": dflash_loss,
    "medusa_loss": medusa_loss,
    "medusa2_loss": medusa2_loss,
    "streaming_loss": streaming_loss,
}


def family_loss(family: Family) -> LossFn:
    """The loss a family's registry entry names (:attr:`Family.loss`)."""
    if family.loss not in LOSSES:
        raise RecipeError(f"drafter family {family.name!r} names the loss {family.loss!r}, which train/losses lacks")
    return LOSSES[family.loss]


def loss_option_names(family: Family) -> list[str]:
    """The recipe's ``loss.*`` keys of a family (its loss's options)."""
    return list(option_defaults(family_loss(family)))


def check_loss_options(family: Family, options: dict[str, Any]) -> dict[str, Any]:
    """The recipe's ``loss`` section checked against the family's loss (see
    :func:`~draftsmith.train.losses.options.check_options`)."""
    return check_options(family_loss(family), options)
