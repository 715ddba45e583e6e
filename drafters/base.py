"""What every trained drafter family declares: its config, its model, and the tree options it drafts with.

- :class:`DrafterConfig`: a ``PretrainedConfig`` whose ``__init__`` keywords are the family's recipe
  options (``drafter.KEY`` in a recipe, one declaration with its default); ``for_target`` fills in
  what comes from the target's config and checks the options.
- :class:`DrafterModel`: what the trainer, ``draftsmith export`` and the runtime call on a drafter,
  with the optional hooks declared once here (no-op defaults) and overridden where a family needs them.
- :class:`TreeOptions`: the tree settings, under one name each in recipes, exported ``config.json``
  files and serve-time specs (``fspad=DIR:top_k=3``).
- :class:`DraftVocabMixin`: drafting from a reduced vocabulary (EAGLE-3's idea).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig

from draftsmith.core.drafting import Drafter, DraftingStep
from draftsmith.core.errors import DraftsmithError
from draftsmith.drafters.engine_layouts import EngineExport, EngineLayoutError, Verifier
from draftsmith.drafters.io import load_drafter_weights, load_weights_into, save_drafter_weights
from draftsmith.drafters.vocab import most_frequent_tokens, vocab_token_ids

if TYPE_CHECKING:  # the gguf package is imported by exports only
    from draftsmith.drafters.gguf_layout import LlamaCppDraft


class UnknownOptionError(DraftsmithError, ValueError):
    """An option key that the drafter (or a recipe section) does not have."""


def check_keys(
    section: str, options: dict[str, Any], known: Sequence[str], error: type[Exception] = UnknownOptionError
) -> None:
    """Unknown ``section.KEY`` keys are errors that suggest the key meant (or its new name)."""
    for key in options:
        if key in known:
            continue
        if RENAMED_OPTIONS.get(key) in known:
            raise error(f"recipe key '{section}.{key}' is now '{section}.{RENAMED_OPTIONS[key]}'")
        close = difflib.get_close_matches(key, list(known), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise error(f"unknown recipe key '{section}.{key}'{hint} (known keys: {', '.join(known)})")


class TreeOptionError(DraftsmithError, ValueError):
    """A tree option a drafter does not take, or a value it cannot use."""


# The largest numbers a tree may be drawn with: far beyond what pays on any device (EAGLE-2 on a GPU drafts
# depth 6, top_k 10, 60 tokens), yet small enough that a typo such as depth=1000 is refused instead of
# running for minutes (or exhausting memory) on trees nobody asked for.
TREE_LIMITS = {"depth": 64, "top_k": 256, "total_tokens": 1024}


def tree_number_problem(key: str, value: Any) -> str | None:
    """Why ``value`` cannot be the tree option ``key`` (a whole number in 1..:data:`TREE_LIMITS`), or None."""
    limit = TREE_LIMITS[key]
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
        return f"{key} takes a whole number from 1 to {limit}"
    return None


# What a declared option type must hold, in words: the types a check can tell apart without running anything.
_PLAIN_TYPES = {bool: "true or false", int: "a whole number", float: "a finite number"}


def option_type_problem(value: Any, declared: Any) -> str | None:
    """Why ``value`` is not of the ``declared`` option type (a boolean, whole number or finite number, or
    ``None`` where the type allows it), in words, or None; other types (lists, tree names) are the
    family's own checks. A YAML ``maybe`` or a JSON ``"true"`` is text, never read as a switch."""
    if typing.get_origin(declared) in (typing.Union, types.UnionType):
        options = [option for option in typing.get_args(declared) if option is not type(None)]
        if value is None and len(options) < len(typing.get_args(declared)):
            return None
        if len(options) != 1:
            return None
        declared = options[0]
    if declared not in _PLAIN_TYPES:
        return None
    if declared is bool:
        fits = isinstance(value, bool)
    elif declared is int:
        fits = isinstance(value, int) and not isinstance(value, bool)
    else:
        fits = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return None if fits else _PLAIN_TYPES[declared]


def top_k_problem(top_k: int | None, draft_vocab_size: int) -> str | None:
    """Why a tree cannot take the ``top_k`` best of a draft vocabulary of ``draft_vocab_size`` tokens, or None."""
    if top_k is not None and draft_vocab_size and top_k > draft_vocab_size:
        return f"top_k={top_k} is more than the drafter's draft vocabulary of {draft_vocab_size} tokens"
    return None


@dataclass(frozen=True)
class TreeOptions:
    """How a trained drafter shapes its draft tree; None = the drafter's own default.

    Each family takes a subset (:attr:`DrafterConfig.TREE_OPTIONS`); the names are the same in a
    recipe (``drafter.top_k``), in the exported ``config.json`` and at serve time (``DIR:top_k=3``)."""

    depth: int | None = None  # levels of the tree (EAGLE, FSPAD)
    top_k: int | None = None  # candidates per expanded node (EAGLE), per head or stream (Medusa, Streaming)
    total_tokens: int | None = None  # draft nodes verified per round
    tree: str | list[list[int]] | None = None  # Medusa: a shipped tree name, choice paths or "dynamic"
    prune: float | None = None  # Speculative Streaming: tree-pruning threshold in [0, 1)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(field.name for field in dataclasses.fields(cls))

    @classmethod
    def parse(cls, values: dict[str, str], allowed: tuple[str, ...], owner: str) -> TreeOptions:
        """Serve-time ``key=value`` strings, checked against the options ``owner`` takes."""
        unknown = sorted(set(values) - set(allowed))
        if unknown:
            raise TreeOptionError(f"{owner} has no tree option {', '.join(unknown)}; it takes {', '.join(allowed)}")
        return cls(**{key: _tree_value(owner, key, text) for key, text in values.items()})

    def problem(self) -> str | None:
        """Why these options cannot draw a tree (a number out of :data:`TREE_LIMITS`), or None: for options
        read from a file (``config.json``, ``tuned_trees.json``) rather than parsed from a command line."""
        for key in TREE_LIMITS:
            value = getattr(self, key)
            if value is not None and (problem := tree_number_problem(key, value)):
                return f"{key}={value!r}: {problem}"
        return None

    def over(self, defaults: TreeOptions) -> TreeOptions:
        """These options where set, ``defaults`` elsewhere."""
        chosen = {name: getattr(self, name) for name in self.names() if getattr(self, name) is not None}
        return dataclasses.replace(defaults, **chosen)


def _tree_value(owner: str, key: str, text: str) -> int | float | str:
    if key == "tree":
        if text.isdigit():
            raise TreeOptionError(f"{owner} tree option tree={text}: tree takes a tree name (e.g. medusa-16, dynamic)")
        return text
    if key == "prune":
        try:
            number = float(text)
        except ValueError:
            number = -1.0
        if not 0.0 <= number < 1.0:
            raise TreeOptionError(f"{owner} tree option prune={text}: prune takes a number in [0, 1), e.g. 0.05")
        return number
    problem = tree_number_problem(key, int(text) if text.isdigit() else None)
    if problem:
        raise TreeOptionError(f"{owner} tree option {key}={text}: {problem}")
    return int(text)


# Recipe and config.json keys renamed to the TreeOptions names; old exports still load.
RENAMED_OPTIONS = {
    "tree_depth": "depth",
    "tree_top_k": "top_k",
    "tree_total_tokens": "total_tokens",
    "pruning_threshold": "prune",
}


class DrafterConfig(PretrainedConfig):
    """Base of every family's config. A subclass's ``__init__`` keywords are its options, except the
    ones in :attr:`DERIVED` (computed from the target by :meth:`from_target_config`)."""

    TREE_OPTIONS: ClassVar[tuple[str, ...]] = ()  # the TreeOptions fields this family takes
    DERIVED: ClassVar[tuple[str, ...]] = ()  # keywords filled in from the target's config, not options
    error: ClassVar[type[Exception]] = DraftsmithError  # raised for options that cannot work

    def __init__(self, drafter_family: str = "", target_identity: dict[str, str] | None = None, **kwargs: Any) -> None:
        self.drafter_family = drafter_family  # the registry key, written into every export
        self.target_identity = target_identity  # the target an export was made for
        super().__init__(**kwargs)

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> Any:
        renamed = {RENAMED_OPTIONS.get(key, key): value for key, value in config_dict.items()}
        return super().from_dict(renamed, **kwargs)

    @classmethod
    def option_names(cls) -> list[str]:
        """The recipe's ``drafter.*`` keys of this family, in declaration order (base classes first)."""
        names: list[str] = []
        derived = {name for klass in cls.__mro__ for name in vars(klass).get("DERIVED", ())}
        for klass in reversed(cls.__mro__):
            if not issubclass(klass, DrafterConfig) or "__init__" not in vars(klass) or klass is DrafterConfig:
                continue
            for parameter in list(inspect.signature(klass.__init__).parameters.values())[1:]:
                if parameter.kind is parameter.VAR_KEYWORD or parameter.name in derived or parameter.name in names:
                    continue
                names.append(parameter.name)
        return names

    @classmethod
    def from_target_config(cls, target_config: PretrainedConfig) -> dict[str, Any]:
        """The :attr:`DERIVED` keywords for ``target_config``."""
        return {}

    @classmethod
    def for_target(cls, target_config: PretrainedConfig, **options: Any) -> DrafterConfig:
        """A drafter config for ``target_config`` with the given options (the rest at their defaults)."""
        check_keys("drafter", options, cls.option_names())
        config = cls(**cls.from_target_config(target_config), **options)
        config.check()
        return config

    @classmethod
    def option_types(cls) -> dict[str, Any]:
        """The declared type of each option (its ``__init__`` annotation), by recipe key."""
        declared: dict[str, Any] = {}
        for klass in reversed(cls.__mro__):
            if issubclass(klass, DrafterConfig) and "__init__" in vars(klass):
                declared.update(typing.get_type_hints(klass.__init__))
        return {name: declared[name] for name in cls.option_names() if name in declared}

    @classmethod
    def check_option_types(cls, options: dict[str, Any]) -> None:
        """Refuse an option that is not of its declared type (a recipe's before any model loads, a
        config's in :meth:`check`); tree numbers are left to :meth:`check`, which says their range too."""
        for name, declared in cls.option_types().items():
            if name in options and name not in TREE_LIMITS:
                if (problem := option_type_problem(options[name], declared)) is not None:
                    raise cls.error(f"drafter.{name} must be {problem}, got {options[name]!r}")

    def check(self) -> None:
        """Refuse options that cannot work, naming the recipe key; the base checks every option against
        its declared type (a recipe, an export's config.json and a serve-time load all pass here), the
        draft vocabulary and the tree options."""
        self.check_option_types({name: getattr(self, name, None) for name in self.option_names()})
        draft_vocab = getattr(self, "draft_vocab_size", 0)
        if draft_vocab is not None and draft_vocab < 0:  # checked before top_k, which it would otherwise blame
            raise self.error(
                f"drafter.draft_vocab_size must be a whole number >= 0 (0: the whole vocabulary), got {draft_vocab}"
            )
        for name in TREE_LIMITS:
            if name in self.TREE_OPTIONS and (problem := tree_number_problem(name, getattr(self, name))):
                raise self.error(f"drafter.{name} is {getattr(self, name)!r}, but {problem}")
        if "top_k" in self.TREE_OPTIONS and (problem := top_k_problem(self.top_k, self.draft_vocab_limit())):
            raise self.error(f"drafter.{problem}; lower drafter.top_k or raise drafter.draft_vocab_size")

    def draft_vocab_limit(self) -> int:
        """How many tokens the drafter chooses among at a position (0: the target's whole vocabulary)."""
        return int(getattr(self, "draft_vocab_size", 0) or 0)

    def _get_generation_parameters(self) -> dict[str, Any]:
        # transformers refuses to save a config holding generation parameters (``top_k``); a drafter's
        # ``top_k`` is a tree option of the same name, not a sampling setting, and drafters have no
        # generation config to move it to.
        return {}

    def feature_layers(self) -> tuple[int, ...]:
        """The target's ``hidden_states`` indices this drafter reads, concatenated in this order
        (0 = the embeddings, i = the state entering layer i, -1 = the input of ``lm_head``). The one
        declaration the runtime, the trainer (online and offline features) and the feature cache read."""
        return (-1,)

    def parallel_depths(self) -> int:
        """The most depths one drafter forward drafts, for families that draft a round in one forward
        (``tree_search.ParallelSearch``: ``draftsmith tune`` tries no deeper tree); 0 for the others."""
        return 0

    def tree_options(self) -> TreeOptions:
        """The tree this drafter drafts by default."""
        return TreeOptions(**{name: getattr(self, name) for name in self.TREE_OPTIONS})


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


class DrafterModel(nn.Module):
    """A trained drafter: built from its config alone, so checkpoints load without a target.

    The trainer calls :meth:`fit_data`, :meth:`init_from_target`, :meth:`load_initial_weights` and
    :meth:`attach_target` in that order; ``draftsmith export`` calls :meth:`save_pretrained` and
    :meth:`parameter_counts` (``--format vllm|speculators|sglang``: :meth:`engine_layout`; ``gguf``:
    :meth:`llamacpp_layout`); the runtime
    calls :meth:`from_pretrained` and :meth:`runtime_drafter`."""

    config_class: ClassVar[type[DrafterConfig]]
    # The names :meth:`parameter_groups` may use, in its order: a recipe's ``train.lr_scale`` keys are
    # checked against them before any model is built.
    PARAMETER_GROUPS: ClassVar[tuple[str, ...]] = ("drafter",)
    # True for drafters that run inside the target (the LoRA families): they train with the target
    # attached (:meth:`attach_target`) and compute their own features, so batches carry none.
    runs_inside_target: ClassVar[bool] = False

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.config = config

    def fit_data(self, token_counts: torch.Tensor) -> None:
        """Data-dependent setup from the training data's (V,) token counts (e.g. a draft vocabulary)."""

    def init_from_target(self, frozen: FrozenTarget) -> None:
        """Initial weights taken from the target (after :meth:`fit_data`; e.g. Medusa's heads copy lm_head)."""

    def attach_target(self, target_model: nn.Module) -> None:
        """Bind to the target model for training, for drafters that run inside it (LoRA families)."""

    def load_initial_weights(self, directory: str | Path) -> list[str]:
        """``train.init_from``: weights of an exported drafter; returns the tensors that start fresh."""
        return load_weights_into(self, directory)

    def parameter_groups(self) -> dict[str, list[nn.Parameter]]:
        """The drafter's own parameters by kind, each kind an optimizer group with its own learning
        rate (``train.lr_scale``); keys among :attr:`PARAMETER_GROUPS`, in that order, every parameter
        in exactly one group (frozen ones included: the trainer leaves those out)."""
        return {"drafter": list(self.parameters())}

    def parameter_counts(self) -> dict[str, int]:
        """The drafter's own parameters by kind (the target's are not counted)."""
        return {name: sum(p.numel() for p in group) for name, group in self.parameter_groups().items()}

    def save_pretrained(self, directory: str | Path) -> None:
        save_drafter_weights(self, directory)

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> DrafterModel:
        return load_drafter_weights(cls, directory)

    def runtime_drafter(self, target_model: nn.Module, tree: TreeOptions) -> Drafter:
        """The runtime :class:`Drafter` that decodes with this model for ``target_model``; ``tree``
        holds serve-time overrides of :meth:`DrafterConfig.tree_options`."""
        raise NotImplementedError(f"{type(self).__name__} must define runtime_drafter()")

    def drafting_step(self, from_target: bool) -> DraftingStep | None:
        """The modules of one drafting forward and its head, for a runtime kernel that computes them in one
        call (:class:`~draftsmith.core.drafting.DraftingStep`), where the model is built that way; None:
        the drafter calls the model's forward. ``from_target``: the forward reads the target's states
        (committed positions), else fed-back features (a tree's nodes)."""
        return None

    def stored_token_ids(self) -> dict[str, torch.Tensor]:
        """The target token ids this drafter stores (its draft vocabulary), by buffer name: a damaged
        value would index out of range deep in the runtime, so the loader range-checks each one.
        Default: every ``draft_vocab`` buffer, the drafter's own or a submodule's."""
        return {name: buffer for name, buffer in self.named_buffers() if name.rsplit(".", 1)[-1] == "draft_vocab"}

    def engine_layout(self, fmt: str, verifier: Verifier, speculative_tokens: int | None) -> EngineExport:
        """This drafter in a serving engine's layout (``fmt``: one of ``ENGINE_FORMATS``) for ``verifier``,
        proposing ``speculative_tokens`` per step by default (None: the family's own default, e.g. its
        tree depth); families an engine can serve override it."""
        raise EngineLayoutError(
            f"a {self.config.drafter_family!r} drafter has no {fmt} layout (no serving engine runs this "
            "family); serve it with `draftsmith generate` or `draftsmith bench`"
        )

    def llamacpp_layout(self, speculative_tokens: int | None) -> LlamaCppDraft:
        """This drafter as llama.cpp loads it (``--format gguf``), proposing ``speculative_tokens`` per step
        by default (None: the family's own); families llama.cpp can serve override it."""
        raise EngineLayoutError(
            f"a {self.config.drafter_family!r} drafter has no gguf layout: llama.cpp's learned drafters are "
            "EAGLE-3 (draft-eagle3) and DFlash-style blocks; export an eagle3 drafter, or serve this one with "
            "`draftsmith generate`"
        )


class DraftVocabMixin:
    """For drafter models that draft only among the training data's most frequent tokens: a
    ``draft_vocab`` buffer of that many token ids (empty = the whole vocabulary), chosen by
    :meth:`fit_data`. Verification stays lossless whatever is proposed."""

    draft_vocab: torch.Tensor

    def _register_draft_vocab(self, size: int) -> None:
        self.register_buffer("draft_vocab", torch.zeros(size, dtype=torch.long))

    def fit_data(self, token_counts: torch.Tensor) -> None:
        """Choose the draft vocabulary from the training data's token counts (a (V,) tensor)."""
        if self.draft_vocab.numel():
            self.draft_vocab.copy_(most_frequent_tokens(token_counts, self.draft_vocab.numel()))

    def token_ids(self, columns: torch.Tensor) -> torch.Tensor:
        """Target token ids of output columns."""
        return vocab_token_ids(self.draft_vocab, columns)

    def vocab_index(self, vocab_size: int) -> torch.Tensor | None:
        """(V,) long: a token's output column, -1 outside the draft vocabulary; None when the outputs
        cover the whole vocabulary."""
        if not self.draft_vocab.numel():
            return None
        index = torch.full((vocab_size,), -1, dtype=torch.long, device=self.draft_vocab.device)
        index[self.draft_vocab] = torch.arange(self.draft_vocab.numel(), device=self.draft_vocab.device)
        return index
