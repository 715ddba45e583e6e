"""Every training recipe shipped in the package parses and validates against its family."""

from pathlib import Path

import pytest

from draftsmith.train.recipe import load_train_recipe
from draftsmith.train.recipe_loader import shipped_recipes
from helpers import NOT_YET

RECIPES = sorted(shipped_recipes().glob("*.yaml"))


def test_the_documented_recipes_are_shipped():
    names = {path.name for path in RECIPES}
    assert {"eagle-smollm2.yaml", "fspad-smollm2.yaml", "eagle-llama3-8b.yaml", "fspad-llama3-8b.yaml"} <= names
    assert {"eagle3-smollm2.yaml", "fspad3-smollm2.yaml", "eagle3-llama3-8b.yaml", "fspad3-llama3-8b.yaml"} <= names
    assert {"medusa1-smollm2.yaml", "medusa2-smollm2.yaml", "streaming-smollm2.yaml"} <= names
    assert {"eagle3-gemma3.yaml", "fspad-gemma3.yaml"} <= names
    assert {"peagle-smollm2.yaml", "dflash-smollm2.yaml"} <= names


def _families(suffix: str) -> dict[str, Path]:
    return {load_train_recipe(path).family_name: path for path in RECIPES if path.stem.endswith(suffix)}


def test_every_family_has_a_gemma3_recipe_but_those_that_do_not_work_on_gemma3_yet():
    not_yet = {family for family, architecture in NOT_YET if architecture == "gemma3"}
    assert set(_families("-gemma3")) == set(_families("-smollm2")) - not_yet


def gemma3_270m_config():
    """Gemma-3-270M's shape (its config.json's numbers; no weights, no package needed)."""
    from transformers import Gemma3TextConfig

    layer_types = (["sliding_attention"] * 5 + ["full_attention"]) * 3
    return Gemma3TextConfig(
        vocab_size=262144,
        hidden_size=640,
        intermediate_size=2048,
        num_hidden_layers=18,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        sliding_window=512,
        layer_types=layer_types,
    )


@pytest.mark.parametrize("path", [p for p in RECIPES if p.stem.endswith("-gemma3")], ids=lambda p: p.name)
def test_a_gemma3_recipes_drafter_fits_gemma3_270m(path):
    from draftsmith.drafters.registry import FAMILIES

    recipe = load_train_recipe(path)
    FAMILIES[recipe.family_name].build_config(gemma3_270m_config(), recipe.drafter_options).check()


def test_the_families_without_a_gemma3_recipe_refuse_gemma3_in_one_line():
    from draftsmith.core.errors import DraftsmithError
    from draftsmith.drafters.registry import FAMILIES

    for family in (family for family, architecture in NOT_YET if architecture == "gemma3"):
        recipe = load_train_recipe(_families("-smollm2")[family])
        with pytest.raises(DraftsmithError, match="gemma3_text"):
            FAMILIES[family].build_config(gemma3_270m_config(), recipe.drafter_options).check()


@pytest.mark.parametrize("path", [p for p in RECIPES if p.stem.endswith("-gemma3")], ids=lambda p: p.name)
def test_a_gemma3_recipe_drafts_from_a_reduced_vocabulary_where_its_family_has_one(path):
    recipe = load_train_recipe(path)
    if "draft_vocab_size" in recipe.drafter:
        assert recipe.drafter["draft_vocab_size"] == 8192  # of Gemma's 262,144 tokens


def test_a_gemma3_recipe_is_its_smollm2_recipes_family_on_gemma3s_own_answers():
    smollm2 = _families("-smollm2")
    for family, path in _families("-gemma3").items():
        gemma3, twin = load_train_recipe(path), load_train_recipe(smollm2[family])
        assert gemma3.data.prepared == "runs/sharegpt-gemma3/prepared" and gemma3.output_dir == f"runs/{path.stem}"
        assert (gemma3.data.features is None) == (twin.data.features is None)
        assert gemma3.drafter.keys() == twin.drafter.keys()


@pytest.mark.parametrize("path", [p for p in RECIPES if p.stem.endswith(("-smollm2", "-gemma3"))], ids=lambda p: p.name)
def test_a_recipe_named_for_a_named_target_trains_that_target(path):
    from draftsmith.core.target import embedded_target

    assert embedded_target(load_train_recipe(path).target.name).name == path.stem.rsplit("-", 1)[1]


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_shipped_recipe_validates(path):
    recipe = load_train_recipe(path)
    assert recipe.output_dir.startswith("runs/") and recipe.data.prepared
