"""Loading a trained drafter exported by ``draftsmith export`` and checking it fits the target."""

from __future__ import annotations

import sys
from pathlib import Path

from draftsmith.core.drafting import Drafter
from draftsmith.core.target import Target
from draftsmith.drafters.base import TreeOptionError, TreeOptions, top_k_problem
from draftsmith.drafters.io import (
    DrafterCheckpointError,
    check_drafter_target,
    check_vocabulary_indices,
    read_drafter_config,
)
from draftsmith.drafters.registry import FAMILIES
from draftsmith.inference.methods.lookup import WithPromptLookup
from draftsmith.inference.methods.tuned_trees import DeviceKey, fitted_tree


def load_drafter(
    directory: str | Path,
    target: Target,
    expect: str | None = None,
    tree: TreeOptions | None = None,
    lookup: int | None = None,
) -> Drafter:
    """The runtime drafter for an exported directory; ``expect`` names the method the user asked for,
    ``tree`` holds serve-time overrides of the drafter's own tree options. With none given, the tree
    ``draftsmith tune`` fitted for this device, dtype and thread count is used when the export has one
    (said in one line on stderr); any serve-time tree option replaces the fitted tree. ``lookup``: the
    prompt-lookup chain grafted onto each tree (:mod:`lookup`); None: the one fitted with the tree where
    that is used, else none."""
    directory = Path(directory)
    config = read_drafter_config(directory)
    name = config["drafter_family"]
    if name not in FAMILIES:
        raise DrafterCheckpointError(f"{directory} holds a {name!r} drafter, which this draftsmith does not know")
    family = FAMILIES[name]
    if expect is not None and family.method_name != expect:
        raise DrafterCheckpointError(
            f"{directory} holds a {name!r} drafter, not {expect!r}; use --method {family.method_name}={directory}"
        )
    check_drafter_target(config, target, directory)
    model = family.model_class.from_pretrained(directory)
    check_vocabulary_indices(model, int(target.model.config.vocab_size), directory)
    model = model.to(target.model.device, target.model.dtype)
    if tree is None or tree == TreeOptions():
        fitted = fitted_tree(directory, DeviceKey.current(target.model))
        if fitted.note:
            print(fitted.note, file=sys.stderr)
        tree = fitted.tree
        lookup = fitted.lookup if lookup is None else lookup
    tree = tree or TreeOptions()
    draft_vocab = model.config.draft_vocab_limit() or int(target.model.config.vocab_size)
    problem = top_k_problem(tree.over(model.config.tree_options()).top_k, draft_vocab)
    if problem:  # torch.topk would fail at the first draft, deep inside decoding
        raise TreeOptionError(f"{directory}: {problem}; choose a smaller top_k")
    drafter = model.runtime_drafter(target.model, tree)
    return WithPromptLookup(drafter, lookup) if lookup else drafter
