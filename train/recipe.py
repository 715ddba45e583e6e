"""The training recipe: one typed schema shared by every drafter family.

A recipe has the sections ``target``, ``output_dir``, ``data``, ``drafter``, ``loss``, ``train`` and
``tracking``. ``drafter`` names the family (``family: fspad``) and carries that family's options;
``loss`` carries the family's loss options; both are checked against the family before anything
heavy is loaded, so a typo is one line, not a traceback after the model has loaded.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

from transformers import PretrainedConfig

from draftsmith.drafters.registry import FAMILIES
from draftsmith.train.losses import check_loss_options
from draftsmith.train.recipe_loader import RecipeError, check_keys, load_recipe


@dataclass
class TargetSection:
    name: str = "smollm2"  # a named target ('smollm2' or 'gemma3'), a model directory, a .gguf file or a hub id
    dtype: str = "float32"  # dtype the frozen target runs in (online features); bfloat16 on GPUs


@dataclass
class DataSection:
    prepared: str = ""  # directory written by `draftsmith data prepare`
    features: Optional[str] = None  # feature cache from `draftsmith data cache-features` -> offline training
    max_length: Optional[int] = None  # cut longer samples to this many tokens (None: as prepared)
    eval_samples: int = 0  # samples held out of training and evaluated at every checkpoint
    # train on this many of the other samples (None: all); smaller counts keep subsets of larger ones and
    # the same held-out samples, for a data-scaling study on one prepared set
    train_samples: Optional[int] = None
    # micro-batches of samples of similar length (less padding); the order still depends on the seed alone
    group_by_length: bool = False


@dataclass
class TrainSection:
    lr: float = 3e-5
    # learning rate of a parameter group as a multiple of `lr`, e.g. {lora: 0.1}; unnamed groups take `lr`.
    # The groups are the family's (medusa2: heads, lora; streaming: streams, pruning, lora; others: drafter)
    lr_scale: dict[str, float] = field(default_factory=dict)
    betas: tuple[float, ...] = (0.9, 0.95)
    weight_decay: float = 0.0
    grad_clip: Optional[float] = 0.5  # max global gradient norm; None turns clipping off
    scheduler: Literal["linear", "cosine", "constant"] = "linear"  # after the warmup
    warmup_steps: int = 0
    max_steps: Optional[int] = None  # optimizer steps; None = `epochs` passes over the data
    # stop this sitting after so many minutes with a checkpoint (resume with --resume); the schedule
    # still runs to max_steps / epochs, so a run split over sittings trains as one would
    max_minutes: Optional[float] = None
    epochs: int = 1
    batch_size: int = 4  # samples per device per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step
    seed: int = 0
    save_every: int = 500  # steps between checkpoints (a final one is always written)
    log_every: int = 10
    keep_last: int = 2  # complete checkpoints kept; older ones are deleted
    # auto: the launcher's choice on a GPU, no on a CPU (bf16 is faster where the CPU has native bfloat16)
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"
    resume: bool = False  # continue from the last complete checkpoint in output_dir
    # with resume: go on even if the checkpoint's random states are missing or damaged (the run then
    # draws other noise than an uninterrupted one would); without it that is an error
    resume_inexact: bool = False
    # with resume: go on even if data.prepared or data.features now hold other data than the run started on
    # (recorded in run_info.json); without it that is an error
    resume_new_data: bool = False
    # a directory written by `draftsmith export` (same family and target) whose weights start this run;
    # parts it lacks start fresh (e.g. Speculative Streaming's pruning adapter, trained afterwards)
    init_from: Optional[str] = None


@dataclass
class TrackingSection:
    wandb: bool = True
    project: str = "draftsmith"
    run_name: Optional[str] = None  # default: the output directory's name
    wandb_mode: Optional[Literal["online", "offline", "disabled"]] = None  # None: $WANDB_MODE, else online
    jsonl: bool = True  # OUTPUT_DIR/metrics.jsonl


@dataclass
class TrainRecipe:
    """A full training run. ``output_dir`` holds checkpoints, metrics and the resolved recipe."""

    output_dir: str
    data: DataSection
    drafter: dict[str, Any]
    target: TargetSection = field(default_factory=TargetSection)
    loss: dict[str, Any] = field(default_factory=dict)
    train: TrainSection = field(default_factory=TrainSection)
    tracking: TrackingSection = field(default_factory=TrackingSection)

    @property
    def family_name(self) -> str:
        return str(self.drafter.get("family", ""))

    @property
    def drafter_options(self) -> dict[str, Any]:
        return {k: v for k, v in self.drafter.items() if k != "family"}

    def feature_layers(self, target_config: PretrainedConfig) -> tuple[int, ...]:
        """The target states (``hidden_states`` indices, -1 = the feature) this recipe's drafter reads,
        as its config declares them (:meth:`DrafterConfig.feature_layers`)."""
        return FAMILIES[self.family_name].build_config(target_config, self.drafter_options).feature_layers()


def recipe_cache_layers(path: str, target_config: PretrainedConfig) -> tuple[int, ...]:
    """``draftsmith data cache-features --recipe``: the extra states a recipe's drafter reads beside
    the feature (which every cache holds)."""
    return tuple(layer for layer in load_train_recipe(Path(path)).feature_layers(target_config) if layer != -1)


def load_train_recipe(path: Path, overrides: Sequence[str] = ()) -> TrainRecipe:
    """Read and fully validate a training recipe (schema, family, family and loss options, numbers)."""
    recipe = load_recipe(Path(path), TrainRecipe, overrides)
    validate(recipe)
    return recipe


def _check_real_numbers(train: TrainSection) -> None:
    """nan passes every ``<=`` test and an infinite rate, decay or norm turns the weights into nan at
    the first step, so each is checked against its whole allowed range."""
    ranges = {
        "train.lr": (train.lr, "a finite number > 0", lambda v: v > 0),
        "train.weight_decay": (train.weight_decay, "a finite number >= 0", lambda v: v >= 0),
        "train.grad_clip": (train.grad_clip, "a finite number >= 0 (0 or null: no clipping)", lambda v: v >= 0),
    }
    for key, (value, allowed, fits) in ranges.items():
        if value is not None and not (math.isfinite(value) and fits(value)):
            raise RecipeError(f"{key} must be {allowed}, got {value}")


MAX_TRAIN_SEED = 2**32 - 1


def validate(recipe: TrainRecipe) -> None:
    """Checks that need no model: the family exists, its options are known, numbers make sense."""
    if "family" not in recipe.drafter:
        raise RecipeError(f"recipe key 'drafter.family' is required (one of: {', '.join(FAMILIES)})")
    if recipe.family_name not in FAMILIES:
        raise RecipeError(f"unknown drafter family {recipe.family_name!r}; available: {', '.join(FAMILIES)}")
    family = FAMILIES[recipe.family_name]
    check_keys("drafter", recipe.drafter_options, family.option_names())
    family.config_class.check_option_types(recipe.drafter_options)  # `feature_sampler: maybe`: before the target loads
    recipe.loss = check_loss_options(family, recipe.loss)  # nan, inf or -1 as a weight: one line
    if not recipe.data.prepared:
        raise RecipeError(
            "recipe key 'data.prepared' is required: a directory made by "
            "`draftsmith data prepare [INPUT] --out DIR --target TARGET`"
        )
    train = recipe.train
    _check_real_numbers(train)
    positive = {
        "train.lr": train.lr,
        "train.epochs": train.epochs,
        "train.batch_size": train.batch_size,
        "train.grad_accum": train.grad_accum,
        "train.save_every": train.save_every,
        "train.log_every": train.log_every,
        "train.keep_last": train.keep_last,
    }
    if train.max_steps is not None:
        positive["train.max_steps"] = train.max_steps
    if train.max_minutes is not None:
        positive["train.max_minutes"] = train.max_minutes
    for key, value in positive.items():
        if value <= 0:
            raise RecipeError(f"{key} must be > 0, got {value}")
    if train.warmup_steps < 0 or recipe.data.eval_samples < 0:
        raise RecipeError("train.warmup_steps and data.eval_samples must be >= 0")
    _check_lr_scale(train.lr_scale, family.name, family.parameter_groups)
    if len(train.betas) != 2:
        raise RecipeError(f"train.betas must be two numbers, got {list(train.betas)}")
    if not all(0 <= beta < 1 for beta in train.betas):
        raise RecipeError(f"train.betas must each be in [0, 1) (e.g. [0.9, 0.95]), got {list(train.betas)}")
    if not 0 <= train.seed <= MAX_TRAIN_SEED:  # accelerate's set_seed seeds numpy too, which takes 32 bits
        raise RecipeError(f"train.seed must be a whole number from 0 to {MAX_TRAIN_SEED}, got {train.seed}")
    if recipe.data.max_length is not None and recipe.data.max_length < 3:
        raise RecipeError(f"data.max_length must be >= 3 tokens, got {recipe.data.max_length}")


def _check_lr_scale(scales: dict[str, Any], family: str, groups: tuple[str, ...]) -> None:
    """``train.lr_scale`` names groups the family has, each with a number > 0."""
    for name, scale in scales.items():
        if name not in groups:
            raise RecipeError(
                f"train.lr_scale.{name}: a {family} drafter has no parameter group {name!r} "
                f"(its groups: {', '.join(groups)})"
            )
        if not scale > 0:  # NaN too
            raise RecipeError(f"train.lr_scale.{name} must be a number > 0, got {scale!r}")
