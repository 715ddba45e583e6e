"""Recipes: typed sections, overrides, unknown keys and the resolved copy."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

import pytest
import yaml

from draftsmith.train.recipe_loader import RecipeError, apply_overrides, load_recipe, parse_override, save_resolved


@dataclass
class Optim:
    lr: float = 3e-5
    betas: tuple[float, ...] = (0.9, 0.95)


@dataclass
class Train:
    max_steps: int = 100
    optim: Optim = field(default_factory=Optim)
    precision: Literal["fp32", "bf16"] = "fp32"


@dataclass
class Recipe:
    target: str
    train: Train = field(default_factory=Train)
    output_dir: Optional[str] = None


def write(tmp_path, text):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    return path


def test_yaml_and_overrides_are_typed(tmp_path):
    path = write(tmp_path, "target: smollm2\ntrain:\n  optim:\n    lr: 5e-5\n")
    recipe = load_recipe(path, Recipe, ["train.max_steps=7", "train.optim.betas=[0.8, 0.9]", "output_dir=runs/x"])
    assert recipe.train.optim.lr == 5e-5 and isinstance(recipe.train.optim.lr, float)
    assert recipe.train.max_steps == 7 and recipe.train.optim.betas == (0.8, 0.9)
    assert recipe.output_dir == "runs/x" and recipe.train.precision == "fp32"


def test_a_bare_no_is_the_word_where_the_choices_hold_it(tmp_path):
    path = write(tmp_path, "target: smollm2\n")
    assert load_recipe(path, Mixed, ["precision=no"]).precision == "no"  # YAML 1.1 reads a bare no as false
    with pytest.raises(RecipeError, match="must be one of"):
        load_recipe(path, Recipe, ["train.precision=no"])  # where "no" is no choice, false stays refused


@dataclass
class Mixed:
    target: str
    precision: Literal["auto", "no", "bf16"] = "auto"


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.max_stepz=3", "unknown recipe key 'train.max_stepz'; did you mean 'max_steps'?"),
        ("train.max_steps=three", "train.max_steps must be int, got 'three'"),
        ("train.precision=fp8", "train.precision must be one of ['fp32', 'bf16']"),
        ("train.optim=3", "train.optim must be a section"),
        ("train", "is not of the form key.sub=value"),
        ("train..lr=1", "is not of the form key.sub=value"),
    ],
)
def test_bad_overrides_name_the_key(tmp_path, override, message):
    path = write(tmp_path, "target: smollm2\n")
    with pytest.raises(RecipeError, match=message.replace("[", r"\[").replace("]", r"\]").replace("?", r"\?")):
        load_recipe(path, Recipe, [override])


def test_unknown_top_level_key_and_missing_required(tmp_path):
    with pytest.raises(RecipeError, match="unknown recipe key 'trian'; did you mean 'train'"):
        load_recipe(write(tmp_path, "target: a\ntrian: {}\n"), Recipe)
    with pytest.raises(RecipeError, match="recipe key 'target' is required"):
        load_recipe(write(tmp_path, "train: {}\n"), Recipe)


def test_bad_yaml_and_missing_file(tmp_path):
    with pytest.raises(RecipeError, match="not valid YAML at line 2"):
        load_recipe(write(tmp_path, "target: a\n  bad: [\n"), Recipe)
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe(tmp_path / "nope.yaml", Recipe)


def test_resolved_recipe_round_trips(tmp_path):
    recipe = load_recipe(write(tmp_path, "target: smollm2\n"), Recipe, ["train.optim.lr=1e-4"])
    saved = save_resolved(recipe, tmp_path / "run")
    tree = yaml.safe_load(saved.read_text())
    assert tree["train"]["optim"] == {"lr": 1e-4, "betas": [0.9, 0.95]}
    assert load_recipe(saved, Recipe) == recipe


def test_parse_override_values():
    assert parse_override("a.b=1") == (["a", "b"], 1)
    assert parse_override("a=true") == (["a"], True)
    assert parse_override("a=") == (["a"], None)
    assert apply_overrides({"a": {"b": 1}}, ["a.c=2"]) == {"a": {"b": 1, "c": 2}}


def test_every_shipped_yaml_parses():
    from accelerate.commands.config.config_args import load_config_from_file

    from draftsmith.train.recipe_loader import shipped_recipes

    root = shipped_recipes()
    accelerate_configs = sorted((root / "accelerate").glob("*.yaml"))
    assert {p.stem for p in accelerate_configs} >= {"zero2", "zero3", "zero3-offload"}
    for path in sorted(root.rglob("*.yaml")):
        assert isinstance(yaml.safe_load(path.read_text()), dict), path
    for path in accelerate_configs:
        config = load_config_from_file(str(path))
        stage = config.deepspeed_config["zero_stage"]
        assert config.distributed_type == "DEEPSPEED" and stage == (2 if path.stem == "zero2" else 3)
        offload = config.deepspeed_config["offload_optimizer_device"]
        assert (offload == "cpu") == path.stem.endswith("offload")
