"""Losses, one per drafter family: ``loss(model, batch, frozen, **options) -> LossOutput``.

The options are the recipe's ``loss`` section; their defaults are the published recipes' values.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

from draftsmith.drafters.registry import Family
from draftsmith.train.batch import LossOutput
from draftsmith.train.losses.dflash import dflash_loss  # noqa: F401 (found by family_loss)
from draftsmith.train.losses.eagle import feature_distillation_loss  # noqa: F401 (found by family_loss)
from draftsmith.train.losses.eagle3 import eagle3_loss  # noqa: F401 (found by family_loss)
from draftsmith.train.losses.medusa import medusa_loss  # noqa: F401 (found by family_loss)
from draftsmith.train.losses.medusa2 import medusa2_loss  # noqa: F401 (found by family_loss)
from draftsmith.train.losses.peagle import peagle_loss  # noqa: F401 (found by family_loss)
from draftsmith.train.losses.streaming import streaming_loss  # noqa: F401 (found by family_loss)
from draftsmith.train.recipe_loader import RecipeError, check_keys

LossFn = Callable[..., LossOutput]  # loss(model, batch: TrainBatch, frozen: FrozenTarget, **options)


def family_loss(family: Family) -> LossFn:
    """The loss function a family names (:attr:`Family.loss`), defined in this module."""
    loss = globals().get(family.loss)
    if not callable(loss):
        raise RecipeError(f"drafter family {family.name!r} names the loss {family.loss!r}, which train/losses.py lacks")
    return loss


def loss_option_names(family: Family) -> list[str]:
    """The recipe's ``loss.*`` keys of a family: its loss function's keywords after (model, batch, frozen)."""
    return list(inspect.signature(family_loss(family)).parameters)[3:]


def check_loss_options(family: Family, options: dict[str, Any]) -> dict[str, Any]:
    """The recipe's ``loss`` section checked against the family's loss function: known keys, and each value
    of its default's kind (a weight, rate or noise a finite number >= 0; a count a whole number >= 0; a
    switch true or false), since nan passes every ``<=`` test and would train on a nan loss. Returns the
    values as numbers (YAML 1.1 reads ``5e-5`` as text)."""
    check_keys("loss", options, loss_option_names(family))
    parameters = list(inspect.signature(family_loss(family)).parameters.values())[3:]
    defaults = {parameter.name: parameter.default for parameter in parameters}
    return {key: _loss_value(f"loss.{key}", value, defaults[key]) for key, value in options.items()}


def _loss_value(key: str, value: Any, default: Any) -> Any:
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise RecipeError(f"{key} must be true or false, got {value!r}")
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise RecipeError(f"{key} must be a whole number >= 0, got {value!r}")
        return value
    if not isinstance(default, float):
        return value
    number = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            pass
    if number is None or not math.isfinite(number) or number < 0:
        raise RecipeError(f"{key} must be a finite number >= 0, got {value!r}")
    return number
