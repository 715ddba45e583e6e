"""On a CUDA GPU: every registered drafter family trains a few steps under bf16 autocast and then
decodes losslessly (float32, greedy) against its served model's plain decoding.

CI has no GPU, so these are skipped there; they run wherever ``torch.cuda.is_available()``, e.g. on a
lent GPU machine with ``python -m pytest tests/test_cuda.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from conftest import tiny_llama
from draftsmith.drafters.base import FrozenTarget
from draftsmith.drafters.registry import FAMILIES, get_family
from draftsmith.inference.runtime import generate
from draftsmith.train.loader import online_features
from draftsmith.train.losses import family_loss
from helpers import hf_greedy, random_prompts, self_distilled_batch, serve

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

VOCAB = 97
EOS = 2
CUDA = torch.device("cuda")
SMALL = {  # keep every family tiny; keys a family does not know are left out
    "num_heads": 3,
    "num_streams": 3,
    "num_stream_layers": 1,
    "lora_rank": 4,
    "lora_alpha": 8,
}


@pytest.fixture(scope="module")
def target():
    return tiny_llama(VOCAB, seed=0).to(CUDA)


@pytest.fixture(scope="module")
def batch(target):
    return self_distilled_batch(target, VOCAB, n=16, new_tokens=32)


def build_on_cuda(name: str, target) -> torch.nn.Module:
    """As the trainer builds a drafter: options, then the target-dependent setup hooks."""
    family = get_family(name)
    options = {k: v for k, v in SMALL.items() if k in family.option_names()}
    torch.manual_seed(0)
    model = family.build(target.config, options)
    model.init_from_target(FrozenTarget.from_model(target))
    model.to(CUDA)
    if model.runs_inside_target:
        model.attach_target(target)
    return model


def with_features_for(model: torch.nn.Module, batch, target):
    """The batch with the target states this drafter reads (EAGLE-3's fused layers), as the trainer gives them."""
    hidden, states = online_features(target, batch, tuple(model.config.feature_layers()))
    return dataclasses.replace(batch, hidden_states=hidden, drafter_states=states)


def train_bf16(name: str, model: torch.nn.Module, batch, target, steps: int) -> list[float]:
    family = get_family(name)
    with torch.no_grad():
        batch = with_features_for(model, batch, target)
    frozen = FrozenTarget.from_model(target)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    model.train()
    for _ in range(steps):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = family_loss(family)(model, batch, frozen)
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        losses.append(float(out.loss.detach()))
    return losses


def served(drafter, target):
    """The model whose plain decoding the drafter must reproduce: an adapted one, or the target."""
    reference = drafter.reference_model()
    return reference if reference is not None else contextlib.nullcontext(target)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_trains_in_bf16_and_decodes_losslessly_on_cuda(name, target, batch):
    model = build_on_cuda(name, target)
    losses = train_bf16(name, model, batch, target, steps=60)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-5:]) < sum(losses[:5])
    drafter = serve(model.eval(), target)
    accepted = 0
    for prompt in random_prompts(8, seed=11, vocab=VOCAB):
        with served(drafter, target) as reference_model:
            reference = hf_greedy(reference_model, prompt, 40)
        result = generate(target, prompt, drafter, max_new_tokens=40, eos_token_ids=[EOS])
        assert result.tokens == reference, prompt
        accepted += len(result.tokens) - result.target_forwards
    assert accepted > 0  # the trained drafts are really accepted on the GPU too


@pytest.mark.parametrize("method", ["none", "pld", "spectra", "draft=layers:1"])
def test_training_free_methods_are_lossless_on_cuda(method, target, tiny_target_dir):
    from draftsmith.core.target import load_target
    from draftsmith.inference.methods.table import build_drafter

    loaded = load_target(str(tiny_target_dir), device="cuda")
    drafter = build_drafter(method, loaded)
    for prompt in random_prompts(6, seed=3, vocab=VOCAB):
        reference = hf_greedy(loaded.model, prompt, 32, eos=loaded.eos_token_ids)
        result = generate(loaded.model, prompt, drafter, max_new_tokens=32, eos_token_ids=loaded.eos_token_ids)
        assert result.tokens == reference


def test_compiled_verification_with_cuda_graphs_is_lossless(target):
    """--compile on CUDA: mode="reduce-overhead" (CUDA graphs per bucket), prompt lookup trees padded."""
    from draftsmith.inference.backends import Backends
    from draftsmith.inference.kernels.options import KernelOptions
    from draftsmith.inference.methods.pld import PromptLookupDrafter

    backends = Backends(KernelOptions(compiled=True))
    for prompt in random_prompts(3, seed=5, vocab=VOCAB):
        prompt = prompt * 4  # repeats give prompt lookup something to draft
        for drafter in (None, PromptLookupDrafter()):
            result = generate(target, prompt, drafter, max_new_tokens=32, eos_token_ids=[EOS], backends=backends)
            assert result.tokens == hf_greedy(target, prompt, 32, EOS)
    assert backends.compiled(target).compile_seconds > 0
