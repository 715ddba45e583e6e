"""The drafting methods the runtime can use, by name: the one place a new method is registered."""

from __future__ import annotations

import re
from collections.abc import Callable

from draftsmith.inference.pld import PromptLookupDrafter
from draftsmith.inference.runtime import Drafter
from draftsmith.inference.spectra import build_spectra_drafter


class MethodError(ValueError):
    """An unknown method name or a bad method argument."""


def _draft_model(target, arg: str | None) -> Drafter:
    # imported here: the draft-model module raises MethodError, so it imports this one
    from draftsmith.inference.draft_model import build_draft_model_drafter

    return build_draft_model_drafter(target, arg)


_TREE_OPTION = re.compile(r"^(?P<rest>.+):(?P<key>[a-z_]+)=(?P<value>[\w.-]+)$")
NAMED_TREE_OPTIONS = ("tree",)  # options whose value is a name (``tree=medusa-16``); the others are numbers
FRACTION_TREE_OPTIONS = ("prune",)  # options whose value is a fraction in [0, 1) (``prune=0.05``)


def split_tree_options(arg: str) -> tuple[str, dict[str, int | str]]:
    """``DIR:depth=4:top_k=3`` -> (``DIR``, {"depth": 4, "top_k": 3}): tree settings chosen at serve time
    (trees that pay off depend on the machine; see ``draftsmith bench-tree``). A value that is not a
    whole number stays a string (``DIR:tree=medusa-16``)."""
    options: dict[str, int | str] = {}
    while match := _TREE_OPTION.match(arg):
        value = match["value"]
        arg, options[match["key"]] = match["rest"], int(value) if value.isdigit() else value
    return arg, options


# Tree settings each trained family's runtime drafter takes at serve time (``fspad=DIR:depth=4``).
TREE_OPTIONS = {
    "eagle": ("depth", "top_k", "total_tokens"),
    "fspad": ("depth", "top_k", "total_tokens"),
    "medusa": ("tree", "top_k", "total_tokens"),  # tree=medusa-16 / dynamic instead of the one in DIR/config.json
    "streaming": ("top_k", "total_tokens", "prune"),  # prune=P: tree-pruning threshold (needs the adapter)
}


def _fraction(family: str, key: str, value: int | str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if not 0.0 <= number < 1.0:
        raise MethodError(f"{family} tree option {key}={value}: {key} takes a number in [0, 1), e.g. 0.05")
    return number


def _trained(family: str) -> Callable[..., Drafter]:
    def build(target, arg: str | None) -> Drafter:
        from draftsmith.inference.learned import load_drafter

        if not arg:
            raise MethodError(f"{family} needs an exported drafter directory: --method {family}=DIR[:key=N...]")
        directory, tree = split_tree_options(arg)
        unknown = sorted(set(tree) - set(TREE_OPTIONS[family]))
        if unknown:
            raise MethodError(
                f"{family} has no tree option {', '.join(unknown)}; it takes {', '.join(TREE_OPTIONS[family])}"
            )
        for key, value in tree.items():
            if key in FRACTION_TREE_OPTIONS:
                tree[key] = _fraction(family, key, value)
            elif isinstance(value, int) == (key in NAMED_TREE_OPTIONS):
                wanted = "a tree name (e.g. medusa-16, dynamic)" if key in NAMED_TREE_OPTIONS else "a whole number"
                raise MethodError(f"{family} tree option {key}={value}: {key} takes {wanted}")
        return load_drafter(directory, target, expect=family, **tree)

    return build


# name -> builder(target, argument after '=' or None)
METHODS: dict[str, Callable[..., Drafter | None]] = {
    "none": lambda target, arg: None,
    "pld": lambda target, arg: PromptLookupDrafter(),
    "spectra": lambda target, arg: build_spectra_drafter(target, arg),  # spectra=INDEX adds SPECTRA-RETRIEVAL
    "spectra-paper": lambda target, arg: build_spectra_drafter(target, arg, paper=True),  # no tree cap (GPU)
    "draft": _draft_model,  # draft=PATH_OR_NAME or draft=layers:N, optionally :k=K
    "eagle": _trained("eagle"),  # eagle=DIR, a directory written by `draftsmith export`
    "fspad": _trained("fspad"),
    # medusa=DIR (Medusa-1 or -2); the tree is the one in DIR/config.json (calibrated or default) unless
    # DIR:tree=NAME picks a shipped one, e.g. to compare a calibrated tree with a default of the same size
    "medusa": _trained("medusa"),
    # streaming=DIR[:prune=P]; decodes with the LoRA-adapted target, lossless w.r.t. it
    "streaming": _trained("streaming"),
}


def build_drafter(spec: str, target) -> Drafter | None:
    """``pld``, ``name=ARG`` (e.g. ``fspad=DIR``) or an exported drafter directory itself."""
    from pathlib import Path

    if "=" not in spec and Path(spec).is_dir():
        from draftsmith.inference.learned import load_drafter

        return load_drafter(spec, target)
    name, _, arg = spec.partition("=")
    if name not in METHODS:
        raise MethodError(f"unknown method {name!r}; available: {', '.join(METHODS)}")
    return METHODS[name](target, arg or None)
