"""Every training recipe shipped in the package parses and validates against its family."""

import pytest

from draftsmith.train.recipe import load_train_recipe
from draftsmith.train.recipe_loader import shipped_recipes

RECIPES = sorted(shipped_recipes().glob("*.yaml"))


def test_the_documented_recipes_are_shipped():
    names = {path.name for path in RECIPES}
    assert {"eagle-smollm2.yaml", "fspad-smollm2.yaml", "eagle-llama3-8b.yaml", "fspad-llama3-8b.yaml"} <= names
    assert {"eagle3-smollm2.yaml", "fspad3-smollm2.yaml", "eagle3-llama3-8b.yaml", "fspad3-llama3-8b.yaml"} <= names
    assert {"medusa1-smollm2.yaml", "medusa2-smollm2.yaml", "streaming-smollm2.yaml"} <= names
    assert {"eagle3-gemma3.yaml", "fspad-gemma3.yaml"} <= names


@pytest.mark.parametrize("path", [p for p in RECIPES if p.stem.endswith(("-smollm2", "-gemma3"))], ids=lambda p: p.name)
def test_a_recipe_named_for_a_named_target_trains_that_target(path):
    from draftsmith.core.target import embedded_target

    assert embedded_target(load_train_recipe(path).target.name).name == path.stem.rsplit("-", 1)[1]


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_shipped_recipe_validates(path):
    recipe = load_train_recipe(path)
    assert recipe.output_dir.startswith("runs/") and recipe.data.prepared
