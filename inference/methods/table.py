"""The drafting methods the runtime can use, by name: the one place a new method is registered."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from draftsmith.core.drafting import Drafter
from draftsmith.drafters.base import TreeOptions
from draftsmith.drafters.pretrained import bundled_drafter, bundled_names
from draftsmith.drafters.registry import FAMILIES, families_served_by
from draftsmith.inference.methods.draft_model import build_draft_model_drafter
from draftsmith.inference.methods.errors import MethodError
from draftsmith.inference.methods.learned import load_drafter
from draftsmith.inference.methods.pld import PromptLookupDrafter, default_num_draft
from draftsmith.inference.methods.spectra import build_spectra_drafter

_TREE_OPTION = re.compile(r"^(?P<rest>.+):(?P<key>[a-z_]+)=(?P<value>[\w.-]+)$")


def split_tree_options(arg: str) -> tuple[str, dict[str, str]]:
    """``DIR:depth=4:top_k=3`` -> (``DIR``, {"depth": "4", "top_k": "3"}): tree settings chosen at serve
    time (trees that pay off depend on the machine; see ``draftsmith bench-tree``)."""
    spec, options = arg, {}
    while match := _TREE_OPTION.match(arg):
        if match["key"] in options:  # the last one would win without a word
            raise MethodError(f"option {match['key']} is given twice in {spec}; give each option once")
        arg, options[match["key"]] = match["rest"], match["value"]
    return arg, options


def method_tree_options(method: str) -> tuple[str, ...]:
    """The tree options a trained method takes: those of every family it serves."""
    names: list[str] = []
    for family in families_served_by(method):
        names += [name for name in family.tree_options if name not in names]
    return tuple(names)


def _trained(method: str) -> Callable[..., Drafter]:
    def build(target, arg: str | None) -> Drafter:
        if not arg or arg.startswith(":"):  # no directory: the drafter shipped for this target, if any
            arg = str(_bundled(method, target)) + (arg or "")
        directory, values = split_tree_options(arg)
        lookup = _lookup_option(method, values.pop("lookup", None))
        tree = TreeOptions.parse(values, method_tree_options(method), method)
        return load_drafter(directory, target, expect=method, tree=tree, lookup=lookup)

    return build


def _lookup_option(method: str, text: str | None) -> int | None:
    """``lookup=N`` of any trained method: graft a prompt-lookup chain of up to N tokens onto each tree
    (:mod:`lookup`); 0: none; absent (None): the length ``draftsmith tune`` fitted with the tree, where
    the fitted tree is used."""
    if text is None:
        return None
    if not text.isdigit():
        raise MethodError(f"{method} option lookup={text}: lookup takes a whole number of tokens >= 0, e.g. lookup=3")
    return int(text)


def _bundled(method: str, target) -> Path:
    families = {family.name for family in families_served_by(method)}
    directory = bundled_drafter(families, target.identity)
    if directory is None:
        shipped = ", ".join(bundled_names()) or "none"
        raise MethodError(
            f"{method} needs an exported drafter directory: --method {method}=DIR[:key=N...] (no {method} "
            f"drafter is shipped for this target; shipped: {shipped})"
        )
    return directory


_PLD_OPTIONS = ("num_draft", "max_ngram")


def _prompt_lookup(target, arg: str | None) -> PromptLookupDrafter:
    """``pld`` or ``pld:num_draft=N:max_ngram=M``; the draft length defaults to what pays where the
    target verifies (``pld.default_num_draft``)."""
    rest, values = split_tree_options("pld" + (arg or ""))
    unknown = sorted(set(values) - set(_PLD_OPTIONS))
    if rest != "pld" or unknown:
        raise MethodError(f"pld takes the options {', '.join(_PLD_OPTIONS)}, e.g. pld:num_draft=5; got pld{arg}")
    numbers = {}
    for key, text in values.items():
        if not text.isdigit() or int(text) < 1:
            raise MethodError(f"pld option {key}={text}: {key} takes a whole number >= 1")
        numbers[key] = int(text)
    numbers.setdefault("num_draft", default_num_draft(target.model.device))
    return PromptLookupDrafter(**numbers)


def _plain(target, arg: str | None) -> None:
    """``none``: plain decoding, which has nothing to set (``none:x=1`` would be ignored without a word)."""
    if arg:
        raise MethodError(f"none (plain decoding) takes no argument or option; got none{_spelt(arg)}")
    return None


def _spectra(paper: bool) -> Callable[..., Drafter]:
    """``spectra`` or ``spectra=INDEX`` (adds SPECTRA-RETRIEVAL); ``paper``: without the CPU tree cap."""
    name = "spectra-paper" if paper else "spectra"

    def build(target, arg: str | None) -> Drafter:
        if arg and arg.startswith(":"):
            raise MethodError(f"{name} takes no options, only an index: {name}=INDEX; got {name}{arg}")
        return build_spectra_drafter(target, arg, paper=paper)

    return build


def _spelt(arg: str) -> str:
    """How the user wrote a method's argument: ``:x=1`` after options, ``=ARG`` after an argument."""
    return arg if arg.startswith(":") else f"={arg}"


# name -> builder(target, argument after '=' or None)
METHODS: dict[str, Callable[..., Drafter | None]] = {
    "none": _plain,
    "pld": _prompt_lookup,  # pld:num_draft=N:max_ngram=M
    "spectra": _spectra(paper=False),  # spectra=INDEX adds SPECTRA-RETRIEVAL
    "spectra-paper": _spectra(paper=True),  # no tree cap (GPU)
    "draft": build_draft_model_drafter,  # draft=PATH_OR_NAME or draft=layers:N, optionally :k=K
    # Trained families, from the registry: NAME=DIR (a directory written by `draftsmith export`), with
    # serve-time tree options DIR:key=value (medusa=DIR:tree=medusa-16, streaming=DIR:prune=0.05).
    **{family.method_name: _trained(family.method_name) for family in FAMILIES.values()},
}


def _names_a_folder(spec: str) -> bool:
    """Whether a method spec is written as a path (``runs/x/drafter``, ``./d``), never a method's name."""
    return "/" in spec or spec.startswith(".") or Path(spec).is_absolute()


def build_drafter(spec: str, target) -> Drafter | None:
    """``pld``, ``name=ARG`` (e.g. ``fspad=DIR``) or an exported drafter directory itself."""
    if "=" not in spec and Path(spec).is_dir():
        return load_drafter(spec, target)
    name, _, arg = spec.partition("=")
    if ":" in name:  # options straight after a method that takes no argument: pld:num_draft=5
        name, _, options = spec.partition(":")
        arg = ":" + options
    if name not in METHODS and _names_a_folder(name):
        raise MethodError(
            f"{name} does not exist: no drafter folder there (an export that was interrupted writes none; run "
            "`draftsmith export` again) and no method of that name"
        )
    if name not in METHODS:
        served_as = f" (a {name} export is served as {FAMILIES[name].method_name}=DIR)" if name in FAMILIES else ""
        raise MethodError(f"unknown method {name!r}{served_as}; available: {', '.join(METHODS)}")
    return METHODS[name](target, arg or None)
