"""Every drafter family end to end, as a user runs it: ``draftsmith train`` for a step, ``draftsmith export``,
then greedy decoding with the export, token-identical to the plain greedy decoding of the model it serves.

Marked ``newest``: ``.ci/run`` runs these again in a fresh environment with the newest releases that
``pyproject.toml`` allows (no lock), where a renamed transformers or peft internal shows first. Each
family runs on the tiny random Llama and (slow) on SmolLM2 with its shipped recipe.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from draftsmith.cli import main
from draftsmith.core.target import load_target
from draftsmith.drafters.registry import FAMILIES
from draftsmith.inference.methods.table import build_drafter
from helpers import (
    NO_SIDE_EFFECTS,
    TINY_DRAFTER,
    assert_decodes_like_plain_greedy,
    prepare_arithmetic_chats,
    shipped_recipe,
)

# transformers' deprecations (a renamed argument, an old output field) warn, and nothing of ours may cause one.
pytestmark = pytest.mark.filterwarnings("error::FutureWarning")

NEW_TOKENS = 16
ONE_STEP = ["train.max_steps=1", "train.batch_size=1", "train.save_every=1", "data.eval_samples=0"]


def test_every_family_is_covered():
    assert set(TINY_DRAFTER) == set(FAMILIES)


@pytest.fixture(autouse=True)
def no_deprecation_logged(caplog):
    """transformers logs (rather than warns) some deprecations, e.g. an output's old ``past_key_values``."""
    yield
    logged = [
        r.getMessage() for r in caplog.records if r.name.startswith("transformers") and "deprecated" in r.getMessage()
    ]
    assert not logged, logged


def train_export_decode(family: str, target_name: str, prepared: Path, tmp_path: Path, overrides: list[str]) -> None:
    """One training step from ``family``'s shipped recipe on ``target_name``, its export, and greedy
    decoding of :data:`~helpers.CHAT_PROMPTS` with it, each identical to the served model's plain greedy decoding."""
    run, export = tmp_path / "run", tmp_path / "export"
    settings = [f"target.name={target_name}", f"data.prepared={prepared}", f"output_dir={run}"]
    main(["train", str(shipped_recipe(family)), *settings, *ONE_STEP, *NO_SIDE_EFFECTS, *overrides])
    main(["export", str(run), "--out", str(export)])
    target = load_target(target_name)
    assert_decodes_like_plain_greedy(target, build_drafter(str(export), target), NEW_TOKENS)


@pytest.fixture(scope="module")
def tiny_prepared(tmp_path_factory, tiny_target_dir) -> Path:
    out = tmp_path_factory.mktemp("newest-tiny") / "prepared"
    prepare_arithmetic_chats(out, tiny_target_dir, 8)
    return out


@pytest.mark.newest
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_family_trains_exports_and_decodes_losslessly_on_the_tiny_target(
    family, tiny_target_dir, tiny_prepared, tmp_path
):
    train_export_decode(family, str(tiny_target_dir), tiny_prepared, tmp_path, TINY_DRAFTER[family])


@pytest.fixture(scope="module")
def smollm2_prepared(tmp_path_factory) -> Path:
    """A few conversations of the bundled default data, cut short: a step takes seconds, not minutes."""
    out = tmp_path_factory.mktemp("newest-smollm2") / "prepared"
    main(["data", "prepare", "--out", str(out), "--limit", "8", "--max-length", "256"])
    return out


@pytest.mark.newest
@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_family_trains_exports_and_decodes_losslessly_on_smollm2(family, smollm2_prepared, tmp_path):
    train_export_decode(family, "smollm2", smollm2_prepared, tmp_path, [])
