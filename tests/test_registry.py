"""The family registry is the one place a family is declared: everything else derives from it."""

import json

import pytest

from conftest import tiny_llama
from draftsmith.core.drafting import Drafter
from draftsmith.core.errors import DraftsmithError
from draftsmith.drafters.base import DrafterModel, TreeOptionError, TreeOptions
from draftsmith.drafters.io import export_drafter
from draftsmith.drafters.registry import FAMILIES
from draftsmith.inference.methods.table import METHODS, build_drafter, method_tree_options
from draftsmith.train.losses import family_loss, loss_option_names

VOCAB = 97


@pytest.fixture(scope="module")
def target():
    return tiny_llama(VOCAB, seed=0, num_hidden_layers=4)  # streaming defaults to the top 4 layers


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_family_builds_trains_and_serves_through_the_declared_interface(target, name):
    family = FAMILIES[name]
    assert callable(family_loss(family)) and isinstance(loss_option_names(family), list)
    assert family.method_name in METHODS
    assert set(family.tree_options) <= set(TreeOptions.names())
    assert set(family.tree_options) <= set(method_tree_options(family.method_name))
    model = family.build(target.config, {})
    assert isinstance(model, DrafterModel) and model.config.drafter_family == name
    assert set(family.option_names()) >= set(family.tree_options)  # tree options are recipe keys too
    drafter = model.runtime_drafter(target, TreeOptions())
    assert isinstance(drafter, Drafter)
    assert model.parameter_counts() and all(n >= 0 for n in model.parameter_counts().values())


def test_tree_options_override_only_what_is_set():
    defaults = TreeOptions(depth=5, top_k=4, total_tokens=12)
    assert TreeOptions(top_k=2).over(defaults) == TreeOptions(depth=5, top_k=2, total_tokens=12)
    assert TreeOptions.parse({"prune": "0.05", "top_k": "3"}, ("top_k", "prune"), "streaming") == TreeOptions(
        top_k=3, prune=0.05
    )
    for values, message in [
        ({"depth": "0"}, "depth takes a whole number from 1 to 64"),
        ({"depth": "1000"}, "depth takes a whole number from 1 to 64"),
        ({"tree": "16"}, "tree takes a tree name"),
        ({"prune": "1.5"}, r"prune takes a number in \[0, 1\)"),
        ({"width": "2"}, "no tree option width"),
    ]:
        with pytest.raises(TreeOptionError, match=message):
            TreeOptions.parse(values, ("depth", "tree", "prune"), "x")


def test_an_export_written_with_the_old_tree_keys_still_loads(tiny_target_dir, tmp_path):
    """Exports from before the option names were unified said tree_depth / tree_top_k / tree_total_tokens."""
    from draftsmith.core.target import load_target

    tiny = load_target(str(tiny_target_dir))
    model = FAMILIES["eagle"].build(tiny.model.config, {"depth": 2, "top_k": 3, "total_tokens": 5})
    export_drafter(model, tiny.identity.to_dict(), tmp_path / "e")
    config = json.loads((tmp_path / "e" / "config.json").read_text())
    for old, new in [("tree_depth", "depth"), ("tree_top_k", "top_k"), ("tree_total_tokens", "total_tokens")]:
        config[old] = config.pop(new)
    (tmp_path / "e" / "config.json").write_text(json.dumps(config))
    (tmp_path / "e" / "files.json").unlink()  # exports of that time recorded no sizes and hashes
    drafter = build_drafter(f"eagle={tmp_path / 'e'}", tiny)
    assert (drafter.depth, drafter.top_k, drafter.total_tokens) == (2, 3, 5)


def test_every_user_error_class_is_a_draftsmith_error():
    """The CLI prints DraftsmithError as one line; a user-facing error class outside it would be a traceback."""
    import draftsmith.core.target as target_module
    import draftsmith.data.features as features
    import draftsmith.data.formats as formats
    import draftsmith.drafters.io as drafter_io
    import draftsmith.inference.measure.errors as bench_errors
    import draftsmith.inference.methods.errors as inference_errors
    import draftsmith.train.checkpoint as checkpoint
    import draftsmith.train.recipe_loader as recipe
    import draftsmith.train.trainer as trainer

    classes = [
        target_module.TargetError,
        features.FeatureCacheError,
        formats.DataError,
        drafter_io.DrafterCheckpointError,
        bench_errors.BenchError,
        inference_errors.MethodError,
        checkpoint.CheckpointError,
        recipe.RecipeError,
        trainer.TrainingError,
        *(family.config_class.error for family in FAMILIES.values()),
    ]
    assert all(issubclass(cls, DraftsmithError) for cls in classes)
    assert not issubclass(formats.RecordError, DraftsmithError)  # a skipped record is counted, not an error
