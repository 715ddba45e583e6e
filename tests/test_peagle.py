"""P-EAGLE drafters: one drafter forward per round, the runtime's depths equal the training-time test
with placeholders, the placeholders are learned, and a short self-distillation gets drafts accepted."""

import pytest
import torch

from conftest import tiny_llama
from draftsmith.core.drafting import DraftContext
from draftsmith.drafters.base import FrozenTarget, TreeOptionError
from draftsmith.drafters.eagle import EagleConfigError
from draftsmith.drafters.engine_layouts import EngineLayoutError
from draftsmith.drafters.registry import get_family
from draftsmith.inference.runtime import generate
from draftsmith.train.losses import family_loss
from draftsmith.train.losses.ttt import ttt_unroll
from helpers import (
    assert_one_drafter_forward_per_round,
    fused_batch,
    hf_greedy,
    random_prompts,
    serve,
    train_from_target,
)

VOCAB = 97
EOS = 2
LAYERS = [0, 2, 3]  # the states entering layers 0, 2 and 3 of the 5-layer target
PEAGLE = get_family("peagle")


@pytest.fixture(scope="module")
def target():
    return tiny_llama(VOCAB, seed=0, num_hidden_layers=5)


@pytest.fixture(scope="module")
def batch(target):
    return fused_batch(target, VOCAB, LAYERS, n=12, new_tokens=32)


def build(target, **options):
    torch.manual_seed(0)
    return PEAGLE.build(target.config, {"aux_layer_ids": LAYERS, **options})


@pytest.fixture(scope="module")
def trained(target, batch):
    return train_from_target("peagle", target, batch, 100, aux_layer_ids=LAYERS)


def context_after(target, prompt, extra):
    tokens = prompt + extra
    with torch.no_grad():
        hidden = target.model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    return DraftContext(tokens, len(prompt), features=torch.cat([hidden[i][0, :-1] for i in LAYERS], -1))


def test_config_keeps_depth_within_training_and_refuses_fspad_parts(target):
    model = build(target)
    assert (model.config.ttt_steps, model.config.depth, model.config.top_k) == (4, 4, 1)  # a chain, vLLM's
    assert model.mask_embedding.shape == (64,) and model.mask_hidden.shape == (3 * 64,)
    with pytest.raises(EagleConfigError, match="drafter.depth=5 drafts past the 4 depths"):
        build(target, depth=5)
    with pytest.raises(EagleConfigError, match="drafter.partial_alignment: P-EAGLE has no FSPAD parts"):
        build(target, partial_alignment=True)
    with pytest.raises(TreeOptionError, match="depth=6 drafts past the 4 depths"):
        serve(model, target, depth=6)
    with pytest.raises(EngineLayoutError, match="SGLang's P-EAGLE layout is not written here"):
        model.engine_layout("sglang", None, None)


def test_a_round_is_one_drafter_forward(target, trained):
    assert_one_drafter_forward_per_round(trained[0], target, [(1, 4), (3, 8)], VOCAB)  # a chain and a tree


def test_runtime_depths_are_the_training_time_test_with_placeholders(target, trained):
    """The depths drafted at decode time, round after round with the drafter's cache, equal the
    training-time test's steps at the last committed position: same inputs, masks and positions."""
    model, _ = trained
    drafter = serve(model, target)
    frozen = FrozenTarget.from_model(target)
    prompt = random_prompts(1, seed=7, vocab=VOCAB)[0]
    continuation = hf_greedy(target, prompt, 6)
    for committed in (1, 3, 3, 6):  # the context grows, then stays, then grows again
        assert_depths_are_the_unroll(model, drafter, frozen, context_after(target, prompt, continuation[:committed]))


def test_a_long_context_is_written_as_keys_and_values_and_drafts_the_same_depths(target, trained):
    """From 16 new committed positions on (a prompt, or a new turn) all but the last only write their keys
    and values: q reads the last one and the placeholders alone, and the depths are still the unroll's."""
    model, _ = trained
    frozen = FrozenTarget.from_model(target)
    prompt = random_prompts(1, seed=7, vocab=VOCAB)[0]
    continuation = hf_greedy(target, prompt, 24)
    whole = context_after(target, prompt, continuation)
    first = assert_depths_are_the_unroll(model, serve(model, target), frozen, whole)
    later_round = serve(model, target)
    assert_depths_are_the_unroll(model, later_round, frozen, context_after(target, prompt, continuation[:2]))
    later = assert_depths_are_the_unroll(model, later_round, frozen, whole)
    assert first == later == [4]  # q read the last committed position and the 3 placeholders only


def assert_depths_are_the_unroll(model, drafter, frozen, context) -> list[int]:
    """The drafter's depths equal the training-time test's; returns the rows its q projection read."""
    rows = []
    hook = model.layer.self_attn.q_proj.register_forward_hook(lambda m, inputs, out: rows.append(inputs[0].shape[-2]))
    try:
        with torch.no_grad():
            drafted = drafter.depth_logits(context.tokens, context.features, 4)
    finally:
        hook.remove()
    with torch.no_grad():
        ids = torch.tensor([context.tokens + [0] * 4])  # what placeholders stand for is never read
        states = torch.cat([context.features, context.features.new_zeros(5, 3 * 64)])[None]
        steps = list(ttt_unroll(model, frozen, ids, torch.ones_like(ids), states))
    last = len(context.tokens) - 2  # the position reading the root token
    unrolled = torch.stack([model.logits(out.token_features[0, last]) for out in steps])
    torch.testing.assert_close(drafted, unrolled, rtol=1e-4, atol=1e-5)
    return rows


def test_loss_trains_the_placeholders_and_only_the_drafter(target, batch):
    model = build(target)
    frozen = FrozenTarget.from_model(target)
    model.init_from_target(frozen)
    out = family_loss(PEAGLE)(model, batch, frozen)
    assert torch.isfinite(out.loss)
    assert {"loss/step0", "loss/step3", "acc/step1", "acc/step4", "sim/accept_length"} <= set(out.metrics)
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    assert model.mask_embedding.grad.abs().sum() > 0 and model.mask_hidden.grad.abs().sum() > 0
    assert frozen.lm_head.weight.grad is None and frozen.embed_tokens.weight.grad is None


def test_a_short_self_distillation_gets_drafts_accepted_losslessly(target, batch, trained):
    model, losses = trained
    start = build(target)
    assert not torch.equal(model.mask_hidden, start.mask_hidden)  # the placeholders were learned
    assert losses[-1] < losses[0] - 0.05
    frozen = FrozenTarget.from_model(target)
    assert family_loss(PEAGLE)(model, batch, frozen).metrics["sim/accept_length"] > 2.0
    for tree in ({"top_k": 1, "total_tokens": 4}, {"top_k": 3, "total_tokens": 8}):
        drafter = serve(model, target, **tree)
        results = [
            generate(target, prompt, drafter, max_new_tokens=40, eos_token_ids=[EOS])
            for prompt in random_prompts(6, seed=11, vocab=VOCAB)
        ]
        for prompt, result in zip(random_prompts(6, seed=11, vocab=VOCAB), results):
            assert result.tokens == hf_greedy(target, prompt, 40)
        tau = sum(len(r.tokens) for r in results) / sum(r.target_forwards for r in results)
        assert tau > 1.3, tree  # its drafts really get accepted


def test_a_reduced_draft_vocabulary_decodes_losslessly(target):
    drafter = serve(build(target, draft_vocab_size=40).eval(), target, top_k=2, total_tokens=6)
    for prompt in random_prompts(6, seed=5, vocab=VOCAB):
        assert generate(target, prompt, drafter, max_new_tokens=30, eos_token_ids=[EOS]).tokens == hf_greedy(
            target, prompt, 30
        )
