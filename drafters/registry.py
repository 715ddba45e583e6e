"""The drafter families draftsmith can train and serve: the one place a family is registered.

A family is one module in ``draftsmith.drafters`` (a :class:`~draftsmith.drafters.base.DrafterConfig`
and a :class:`~draftsmith.drafters.base.DrafterModel`), one loss module in ``draftsmith.train.losses``
(its loss named here, held under that name in ``draftsmith.train.losses.LOSSES``: this folder never
imports training code), one recipe, and one entry in :data:`FAMILIES`. The trainer, recipe checks, ``draftsmith
export``, the runtime's ``--method`` table and its serve-time tree options all read this table; the
key is written into every exported ``config.json`` (``drafter_family``), so loading never guesses.

Names say which side a class is on: the ``nn.Module`` a family trains, saves and exports is its model
(``EagleModel``, ``Eagle3Model``, ``MedusaHeads``, ``Medusa2Model``, ``StreamingModel``); what its
``runtime_drafter()`` returns for decoding is a runtime drafter (``EagleTreeDrafter``,
``MedusaTreeDrafter``, ...: a :class:`~draftsmith.core.drafting.Drafter`). Tools that treat families
differently (``draftsmith tune``, ``draftsmith medusa calibrate``, ``bench``'s vLLM engine) read the fields
below, never the classes: ``tune`` asks :attr:`Family.tree_search` for its candidate trees.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from transformers import PretrainedConfig

from draftsmith.core.errors import DraftsmithError
from draftsmith.drafters.base import DrafterConfig, DrafterModel
from draftsmith.drafters.dflash import DFlashConfig, DFlashModel
from draftsmith.drafters.eagle import EagleConfig, EagleModel
from draftsmith.drafters.eagle3 import Eagle3Config, Eagle3Model
from draftsmith.drafters.io import weight_count
from draftsmith.drafters.medusa import MedusaConfig, MedusaHeads
from draftsmith.drafters.medusa2 import Medusa2Config, Medusa2Model
from draftsmith.drafters.peagle import PEagleConfig, PEagleModel
from draftsmith.drafters.streaming import StreamingConfig, StreamingModel
from draftsmith.drafters.tree_search import GrowthSearch, HeadsSearch, ParallelSearch, TreeSearch

# A drafter of more weights than this many times its target's is refused (a recipe's drafter.* options):
# a drafter is meant to cost a fraction of the target (Medusa's four full-vocabulary heads: 0.8x SmolLM2),
# and one of, say, lora_rank=100000 would exhaust the memory while it is being allocated.
MAX_DRAFTER_RATIO = 10


class DrafterSizeError(DraftsmithError, ValueError):
    """Drafter options that make a drafter far larger than its target."""


class UnknownFamilyError(DraftsmithError, ValueError):
    """A drafter family name this draftsmith does not know."""


# the tree searches ``draftsmith tune`` runs (drafters/tree_search.py), one per kind of tree
GROWTH, HEADS, PARALLEL = GrowthSearch(), HeadsSearch(), ParallelSearch()


@dataclass(frozen=True)
class Family:
    """How to build, train, save and serve one kind of drafter.

    ``defaults`` are option values that distinguish this entry from another entry sharing the same
    classes (``fspad`` is ``eagle`` with the feature sampler and partial alignment switched on)."""

    name: str
    config_class: type[DrafterConfig]
    model_class: type[DrafterModel]
    loss: str  # its loss's name in draftsmith.train.losses.LOSSES
    defaults: dict[str, Any] = dataclasses.field(default_factory=dict)
    method: str = ""  # the runtime method that serves it (``--method medusa=DIR``); "" = its name
    # Families whose exports may start a run of this one (``train.init_from``), besides itself:
    # Medusa-2's two-stage recipe starts from trained Medusa-1 heads; P-EAGLE from an EAGLE-3, whose
    # first step is its depth 0 (only the placeholders start fresh).
    starts_from: tuple[str, ...] = ()
    # How ``draftsmith tune`` fits its tree to a device: the candidate trees and how their acceptance is
    # read (drafters/tree_search.py); None: its drafts come from elsewhere (inside the target's forward)
    # and there is no tree to fit.
    tree_search: TreeSearch | None = None
    # vLLM's speculative_config entries that serve its engine export (``draftsmith export --format vllm``;
    # ``bench`` method ``vllm=DIR``) besides the drafter and its tokens; () = vLLM does not serve it.
    vllm_method: tuple[tuple[str, Any], ...] = ()
    # Its static tree can be calibrated from the heads' measured accuracy (``draftsmith medusa calibrate``).
    calibrated_tree: bool = False

    @property
    def needs_features(self) -> bool:
        """The training batch must carry the target's ``hidden_states`` (the LoRA families make their own)."""
        return not self.model_class.runs_inside_target

    @property
    def method_name(self) -> str:
        return self.method or self.name

    @property
    def tree_options(self) -> tuple[str, ...]:
        """The serve-time tree options (``--method NAME=DIR:top_k=3``) its drafters take."""
        return self.config_class.TREE_OPTIONS

    @property
    def parameter_groups(self) -> tuple[str, ...]:
        """The optimizer groups its drafters may have (``train.lr_scale`` keys)."""
        return self.model_class.PARAMETER_GROUPS

    def option_names(self) -> list[str]:
        """The recipe's ``drafter.*`` keys."""
        return self.config_class.option_names()

    def build_config(self, target_config: PretrainedConfig, options: dict[str, Any]) -> DrafterConfig:
        config = self.config_class.for_target(target_config, **{**self.defaults, **options})
        config.drafter_family = self.name  # what the loader looks up in FAMILIES
        return config

    def build(
        self, target_config: PretrainedConfig, options: dict[str, Any], target_weights: int | None = None
    ) -> DrafterModel:
        """The drafter for ``target_config`` with the recipe's ``options``; given the target's own number of
        weights, a drafter of more than :data:`MAX_DRAFTER_RATIO` times as many is refused before anything
        is allocated, naming the options that make it so (``drafter.lora_rank=100000``)."""
        config = self.build_config(target_config, options)
        if target_weights is not None:
            self._check_size(target_config, options, config, target_weights)
        return self.model_class(config)

    def _check_size(
        self, target_config: PretrainedConfig, options: dict[str, Any], config: DrafterConfig, target_weights: int
    ) -> None:
        weights = weight_count(self.model_class, config)
        if weights <= MAX_DRAFTER_RATIO * target_weights:
            return
        culprits = [key for key in options if self._weights_without(target_config, options, key) < weights]
        named = culprits or list(options)
        given = ", ".join(f"drafter.{key}={options[key]!r}" for key in named) or "the default options"
        fix = f"lower {', '.join(f'drafter.{key}' for key in named)}" if named else "choose a smaller family"
        raise DrafterSizeError(
            f"{given} would make a {self.name} drafter of {weights:,} weights, more than {MAX_DRAFTER_RATIO} times "
            f"the target's {target_weights:,} (a drafter is meant to be far smaller than its target); {fix}"
        )

    def _weights_without(self, target_config: PretrainedConfig, options: dict[str, Any], key: str) -> int:
        """The drafter's weights with option ``key`` at its default (-1 when that cannot be built)."""
        try:
            config = self.build_config(target_config, {k: v for k, v in options.items() if k != key})
        except DraftsmithError:
            return -1
        return weight_count(self.model_class, config)


FAMILIES: dict[str, Family] = {
    "eagle": Family(
        "eagle",
        EagleConfig,
        EagleModel,
        "feature_distillation_loss",
        tree_search=GROWTH,
        vllm_method=(("method", "eagle"),),
    ),
    "fspad": Family(
        "fspad",
        EagleConfig,
        EagleModel,
        "feature_distillation_loss",
        defaults={"feature_sampler": True, "partial_alignment": True},
        tree_search=GROWTH,
    ),
    "eagle3": Family(
        "eagle3", Eagle3Config, Eagle3Model, "eagle3_loss", tree_search=GROWTH, vllm_method=(("method", "eagle3"),)
    ),
    "fspad3": Family(
        "fspad3",
        Eagle3Config,
        Eagle3Model,
        "eagle3_loss",
        defaults={"feature_sampler": True, "partial_alignment": True},
        tree_search=GROWTH,
    ),
    # P-EAGLE drafts every depth from one forward: its tree is a Cartesian one over the depths' top-k;
    # vLLM serves it as eagle3 drafting every token in one forward.
    "peagle": Family(
        "peagle",
        PEagleConfig,
        PEagleModel,
        "peagle_loss",
        starts_from=("eagle3",),
        tree_search=PARALLEL,
        vllm_method=(("method", "eagle3"), ("parallel_drafting", True)),
    ),
    # DFlash denoises a block in one forward: a chain (or Cartesian tree) of its masked positions' top-k
    # (vLLM turns parallel drafting on for its dflash method by itself).
    "dflash": Family(
        "dflash", DFlashConfig, DFlashModel, "dflash_loss", tree_search=PARALLEL, vllm_method=(("method", "dflash"),)
    ),
    "medusa": Family(
        "medusa",
        MedusaConfig,
        MedusaHeads,
        "medusa_loss",
        tree_search=HEADS,
        calibrated_tree=True,
        vllm_method=(("method", "medusa"),),
    ),
    # Medusa-2 trains a LoRA on the target with the heads and computes its own (adapted) features; its
    # heads are Medusa-1's, so its trees are tuned and calibrated alike (over the adapted features).
    "medusa2": Family(
        "medusa2",
        Medusa2Config,
        Medusa2Model,
        "medusa2_loss",
        method="medusa",
        starts_from=("medusa",),
        tree_search=HEADS,
        calibrated_tree=True,
    ),
    # Speculative Streaming runs inside the target (attach_target): no features, the target's own tokens.
    "streaming": Family("streaming", StreamingConfig, StreamingModel, "streaming_loss"),
}


def get_family(name: str) -> Family:
    if name not in FAMILIES:
        raise UnknownFamilyError(f"unknown drafter family {name!r}; available: {', '.join(FAMILIES) or 'none'}")
    return FAMILIES[name]


def families_served_by(method: str) -> list[Family]:
    """The families a runtime method name serves (``medusa`` serves Medusa-1 and Medusa-2)."""
    return [family for family in FAMILIES.values() if family.method_name == method]
