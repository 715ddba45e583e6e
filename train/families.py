"""The drafter families draftsmith can train and serve: the one place a family is registered.

A family is one module in ``draftsmith.drafters`` (its ``PretrainedConfig`` subclass and model) plus
one loss in ``draftsmith.train.losses``. The trainer, ``draftsmith export`` and the runtime's loader
find everything through :data:`FAMILIES`; the key is written into every exported ``config.json``
(``drafter_family``), so loading never guesses.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn
from transformers import PretrainedConfig

from draftsmith.drafters.eagle import EagleConfig, EagleDrafter, EagleTreeDrafter
from draftsmith.drafters.medusa import MedusaConfig, MedusaHeads, MedusaTreeDrafter
from draftsmith.drafters.medusa2 import Medusa2Config, Medusa2Model, serve_medusa2
from draftsmith.drafters.streaming import StreamingConfig, StreamingModel, serve_streaming
from draftsmith.train.batch import FrozenTarget, LossOutput, TrainBatch
from draftsmith.train.losses import feature_distillation_loss, medusa2_loss, medusa_loss, streaming_loss
from draftsmith.train.recipe import RecipeError

LossFn = Callable[..., LossOutput]  # loss(model, batch: TrainBatch, frozen: FrozenTarget, **options)


@dataclass(frozen=True)
class Family:
    """How to build, train and save one kind of drafter.

    ``defaults`` are option values that distinguish this entry from another entry sharing the same
    classes (``fspad`` is ``eagle`` with the feature sampler and partial alignment switched on)."""

    name: str
    config_class: type[PretrainedConfig]  # has ``for_target(target_config, **options)``
    model_class: type[nn.Module]  # ``model_class(config)``; ``save_pretrained`` / ``from_pretrained``
    loss: LossFn
    # serve(model, target_model, **tree_options) -> the runtime Drafter that decodes with a trained model
    serve: Callable[..., Any] | None = None
    defaults: dict[str, Any] = dataclasses.field(default_factory=dict)
    needs_features: bool = True  # the batch must carry the target's ``hidden_states``
    method: str = ""  # the runtime method that serves it (``--method medusa=DIR``); "" = its name
    # Families whose exports may start a run of this one (``train.init_from``), besides itself:
    # Medusa-2's two-stage recipe starts from trained Medusa-1 heads.
    starts_from: tuple[str, ...] = ()

    def option_names(self) -> list[str]:
        return list(inspect.signature(self.config_class.for_target).parameters)[1:]

    def loss_option_names(self) -> list[str]:
        return [p for p in list(inspect.signature(self.loss).parameters)[3:]]

    def build_config(self, target_config: PretrainedConfig, options: dict[str, Any]) -> PretrainedConfig:
        """The drafter's config for ``target_config``; unknown option keys are recipe errors."""
        _check_keys("drafter", options, self.option_names())
        config = self.config_class.for_target(target_config, **{**self.defaults, **options})
        config.drafter_family = self.name  # what the loader looks up in FAMILIES
        return config

    def build(self, target_config: PretrainedConfig, options: dict[str, Any]) -> nn.Module:
        return self.model_class(self.build_config(target_config, options))

    def check_loss_options(self, options: dict[str, Any]) -> None:
        _check_keys("loss", options, self.loss_option_names())

    def compute_loss(
        self, model: nn.Module, batch: TrainBatch, frozen: FrozenTarget, options: dict[str, Any]
    ) -> LossOutput:
        return self.loss(model, batch, frozen, **options)


def _check_keys(section: str, options: dict[str, Any], known: list[str]) -> None:
    import difflib

    for key in options:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise RecipeError(f"unknown recipe key '{section}.{key}'{hint} (known keys: {', '.join(known)})")


def _serve_eagle(model: EagleDrafter, target_model: nn.Module, **tree: Any) -> EagleTreeDrafter:
    frozen = FrozenTarget.from_model(target_model)
    return EagleTreeDrafter(model, frozen.embed_tokens, frozen.lm_head, name=model.config.drafter_family, **tree)


def _serve_medusa(model: MedusaHeads, target_model: nn.Module, **tree: Any) -> MedusaTreeDrafter:
    # The heads own their output layers; the target is only the verifier.
    return MedusaTreeDrafter(model, name=model.config.drafter_family, **tree)


FAMILIES: dict[str, Family] = {
    "eagle": Family("eagle", EagleConfig, EagleDrafter, feature_distillation_loss, _serve_eagle),
    "fspad": Family(
        "fspad",
        EagleConfig,
        EagleDrafter,
        feature_distillation_loss,
        _serve_eagle,
        defaults={"feature_sampler": True, "partial_alignment": True},
    ),
    "medusa": Family("medusa", MedusaConfig, MedusaHeads, medusa_loss, _serve_medusa),
    # Medusa-2 trains a LoRA on the target with the heads and computes its own (adapted) features.
    "medusa2": Family(
        "medusa2",
        Medusa2Config,
        Medusa2Model,
        medusa2_loss,
        serve_medusa2,
        needs_features=False,
        method="medusa",
        starts_from=("medusa",),
    ),
    # Speculative Streaming runs inside the target (attach_target): no features, the target's own tokens.
    "streaming": Family(
        "streaming", StreamingConfig, StreamingModel, streaming_loss, serve_streaming, needs_features=False
    ),
}


def get_family(name: str) -> Family:
    if name not in FAMILIES:
        raise RecipeError(f"unknown drafter family {name!r}; available: {', '.join(FAMILIES) or 'none'}")
    return FAMILIES[name]


# Writing the exported directory is family-independent; re-exported here for ``draftsmith export``.
from draftsmith.drafters.io import export_drafter  # noqa: E402,F401
