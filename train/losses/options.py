"""A loss with its options: the recipe's ``loss`` section as a dataclass, checked before a run starts."""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from draftsmith.train.batch import LossOutput
from draftsmith.train.recipe_loader import RecipeError, check_keys


@dataclass(frozen=True)
class Loss:
    """A loss whose options are a dataclass (``options``) rather than keywords of its own:
    ``compute(model, batch, frozen, options)``. Called like the keyword losses,
    ``loss(model, batch, frozen, **options)``, so the trainer and recipes treat every family alike."""

    compute: Callable[..., LossOutput]
    options: type

    def __call__(self, model, batch, frozen, **options: Any) -> LossOutput:
        return self.compute(model, batch, frozen, self.options(**options))


LossFn = Callable[..., LossOutput]  # loss(model, batch: TrainBatch, frozen: FrozenTarget, **options)


def option_defaults(loss: LossFn) -> dict[str, Any]:
    """The recipe's ``loss.*`` keys of a loss and their defaults: its options dataclass's fields, or a
    keyword loss's keywords after (model, batch, frozen)."""
    if isinstance(loss, Loss):
        return {field.name: field.default for field in dataclasses.fields(loss.options)}
    return {parameter.name: parameter.default for parameter in list(inspect.signature(loss).parameters.values())[3:]}


def check_options(loss: LossFn, options: dict[str, Any]) -> dict[str, Any]:
    """The recipe's ``loss`` section checked against ``loss``: known keys, and each value of its default's
    kind (a weight, rate or noise a finite number >= 0; a count a whole number >= 0; a switch true or
    false), since nan passes every ``<=`` test and would train on a nan loss. Returns the values as numbers
    (YAML 1.1 reads ``5e-5`` as text)."""
    defaults = option_defaults(loss)
    check_keys("loss", options, list(defaults))
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
