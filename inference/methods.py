"""The drafting methods the runtime can use, by name: the one place a new method is registered."""

from __future__ import annotations

from collections.abc import Callable

from draftsmith.inference.pld import PromptLookupDrafter
from draftsmith.inference.runtime import Drafter


class MethodError(ValueError):
    """An unknown method name or a bad method argument."""


# name -> builder(target, argument after '=' or None)
METHODS: dict[str, Callable[..., Drafter | None]] = {
    "none": lambda target, arg: None,
    "pld": lambda target, arg: PromptLookupDrafter(),
}


def build_drafter(spec: str, target) -> Drafter | None:
    """``pld`` or ``name=ARG`` (e.g. a checkpoint directory for trained drafters)."""
    name, _, arg = spec.partition("=")
    if name not in METHODS:
        raise MethodError(f"unknown method {name!r}; available: {', '.join(METHODS)}")
    return METHODS[name](target, arg or None)
