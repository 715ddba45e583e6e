"""What every drafter family must do, on every tiny target architecture: the conformance suite.

Each family in :data:`~draftsmith.drafters.registry.FAMILIES` runs from its shipped recipe on the tiny
random Llama and the tiny random Gemma-3 (sliding-window and full-attention layers): a training step
changes the drafter, a run interrupted and resumed ends bit-for-bit where the uninterrupted one does, the
export loads back to the trained weights, and decoding with it is lossless: greedy decoding is token
identical to the served model's plain greedy decoding, and sampled decoding is reproducible and draws
the served model's exact distribution (chi-square over the first tokens). A new family or architecture
is one entry in the registry or in :data:`ARCHITECTURES`; what is specific to a family stays in its own
test module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.core.target import Target, load_target
from draftsmith.core.verify import SamplingConfig
from draftsmith.drafters.io import DrafterCheckpointError, export_drafter
from draftsmith.drafters.registry import FAMILIES
from draftsmith.inference.backends import Backends
from draftsmith.inference.methods.lookup import WithPromptLookup
from draftsmith.inference.methods.table import build_drafter
from draftsmith.train.recipe import load_train_recipe
from draftsmith.train.trainer import train
from helpers import (
    NO_SIDE_EFFECTS,
    NOT_YET,
    TINY_DRAFTER,
    assert_decodes_like_plain_greedy,
    chi_square_p_value,
    exact_distribution,
    interrupt_at,
    losses,
    prepare_arithmetic_chats,
    sample_counts,
    sampled_twice,
    served_model,
    shipped_recipe,
)

ARCHITECTURES = ("llama", "gemma3")
TARGET_DIRS = {"llama": "tiny_target_dir", "gemma3": "tiny_gemma3_dir"}
TWO_STEPS = [
    "train.max_steps=2",
    "train.batch_size=2",
    "train.save_every=1",
    "train.log_every=1",
    "data.eval_samples=0",
]
NEW_TOKENS = 16
# Top-3 sampling keeps the enumeration of the first three tokens at 27 sequences on any vocabulary.
SAMPLING = SamplingConfig(temperature=1.0, top_k=3)
SAMPLED_TOKENS, SAMPLES = 3, 600


@pytest.fixture(scope="module", params=ARCHITECTURES)
def architecture(request) -> str:
    return request.param


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def target_dir(request, architecture) -> Path:
    return request.getfixturevalue(TARGET_DIRS[architecture])


@pytest.fixture(scope="module")
def target(target_dir) -> Target:
    return load_target(str(target_dir))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, target_dir, architecture) -> Path:
    out = tmp_path_factory.mktemp(f"conformance-{architecture}") / "prepared"
    prepare_arithmetic_chats(out, target_dir, 8)
    return out


@dataclass
class Runs:
    """Two steps straight (``straight``), the same two steps interrupted after the first and resumed
    (``resumed``), and the straight run's export."""

    straight: Path
    resumed: Path
    export: Path

    def weights(self, run: Path, step: int) -> dict[str, torch.Tensor]:
        return load_file(str(run / "checkpoints" / f"step-{step}" / "drafter" / "model.safetensors"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, family, architecture, target_dir, prepared) -> Runs:
    """The runs of ``family`` on ``architecture``; for a :data:`NOT_YET` pair, each of its tests an
    expected failure, and a failure once the pair works (strict)."""
    reason = NOT_YET.get((family, architecture))
    try:
        made = train_resume_and_export(tmp_path_factory.mktemp(f"conformance-{family}"), family, target_dir, prepared)
    except Exception:
        if reason:
            pytest.xfail(reason)
        raise
    if reason:
        pytest.fail(f"{family} on {architecture} works now: take it out of NOT_YET")
    return made


def train_resume_and_export(root: Path, family: str, target_dir: Path, prepared: Path) -> Runs:
    from draftsmith.train.export import export_run

    made = Runs(root / "straight", root / "resumed", root / "export")

    def recipe(run: Path):
        settings = [f"target.name={target_dir}", f"data.prepared={prepared}", f"output_dir={run}"]
        return load_train_recipe(
            shipped_recipe(family), [*settings, *TWO_STEPS, *NO_SIDE_EFFECTS, *TINY_DRAFTER[family]]
        )

    train(recipe(made.straight))
    with pytest.MonkeyPatch.context() as patch:
        interrupt_at(patch, 1)  # dies as step 2 starts, after checkpoint step-1
        with pytest.raises(KeyboardInterrupt):
            train(recipe(made.resumed))
    train(recipe(made.resumed), resume=True)
    export_run(made.straight, made.export)
    return made


@pytest.fixture(scope="module")
def drafter(runs, target):
    """The export served on the target, loaded once (a LoRA family's adapter goes on the target once)."""
    return build_drafter(str(runs.export), target)


def test_a_training_step_trains_the_drafter(runs):
    curve = losses(runs.straight)
    assert sorted(curve) == [1, 2] and all(torch.isfinite(torch.tensor(list(curve.values()))))
    first, second = runs.weights(runs.straight, 1), runs.weights(runs.straight, 2)
    assert any(not torch.equal(first[key], second[key]) for key in first)
    info = json.loads((runs.straight / "run_info.json").read_text())
    assert sum(t.numel() for t in second.values() if t.is_floating_point()) == info["trainable_parameters"]


def test_an_interrupted_run_resumes_exactly(runs):
    assert losses(runs.resumed) == pytest.approx(losses(runs.straight), rel=1e-6, abs=1e-9)
    straight, resumed = runs.weights(runs.straight, 2), runs.weights(runs.resumed, 2)
    assert set(straight) == set(resumed)
    for key in straight:
        torch.testing.assert_close(resumed[key], straight[key], rtol=1e-6, atol=1e-7, msg=key)


def test_the_export_round_trips(runs, family):
    exported = FAMILIES[family].model_class.from_pretrained(runs.export)
    assert exported.config.drafter_family == family
    trained = runs.weights(runs.straight, 2)
    assert set(exported.state_dict()) >= set(trained)
    for key, value in trained.items():
        assert torch.equal(exported.state_dict()[key], value), key
    with pytest.raises(FileExistsError):
        export_drafter(exported, {}, runs.export)  # an export never overwrites another
    broken = runs.export.parent / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((runs.export / "config.json").read_text())
    with pytest.raises(DrafterCheckpointError, match="model.safetensors is missing"):
        FAMILIES[family].model_class.from_pretrained(broken)


def test_greedy_decoding_is_token_identical_to_plain_decoding(drafter, family, target):
    assert drafter.name == family
    assert_decodes_like_plain_greedy(target, drafter, NEW_TOKENS)


def test_greedy_decoding_with_prompt_lookup_grafted_on_is_token_identical(drafter, target):
    assert_decodes_like_plain_greedy(target, WithPromptLookup(drafter, 4), NEW_TOKENS)


def test_sampled_decoding_is_reproducible_and_draws_the_exact_distribution(drafter, target):
    prompt = target.encode_chat([{"role": "user", "content": "Explain how a rainbow forms."}])
    twice = sampled_twice(target.model, drafter, prompt)
    assert twice[0] == twice[1] and len(twice[0]) > 0  # the drafter adds no randomness of its own
    counts = sample_counts(
        target.model, drafter, SAMPLING, 5, Backends(), prompt=prompt, n=SAMPLES, steps=SAMPLED_TOKENS
    )  # one set of kernels for every sample: built per generation they cost more than the sample
    with served_model(drafter, target.model) as served:
        exact = exact_distribution(served, SAMPLING, prompt, SAMPLED_TOKENS)
    assert chi_square_p_value(counts, exact, SAMPLES) > 1e-3
