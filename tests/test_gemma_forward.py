"""Gemma-3's direct verification forward: bitwise the model's own forward (logits, hidden states, cache) on
one-token steps and tree forwards on both sides of the sliding window, packed or not; greedy decoding
through it equals plain decoding."""

from contextlib import nullcontext

import pytest
import torch

from conftest import TINY_GEMMA3, tiny_gemma3
from draftsmith.core.cache import preallocated_cache_for
from draftsmith.core.cache_kwarg import cache_kwargs
from draftsmith.core.tree import DraftTree, TreeInputBuffers
from draftsmith.inference.backends import Backends, FastPaths, verification_forward
from draftsmith.inference.kernels.attention import model_attention
from draftsmith.inference.kernels.direct import direct_forward_for
from draftsmith.inference.kernels.gemma_forward import GemmaDirectForward
from draftsmith.inference.kernels.options import KernelOptions
from draftsmith.inference.kernels.packed_gemm import PackedGemm, linear_kernel_available
from draftsmith.inference.methods.pld import PromptLookupDrafter
from draftsmith.inference.runtime import generate
from helpers import hf_greedy, seeded_random_tree

VOCAB = 97
WINDOW = TINY_GEMMA3["sliding_window"]
# prompts (the last token is the root) shorter than the window, reaching it, and past it
PROMPTS = {length: [(7 * i + 5) % VOCAB for i in range(length)] for length in (5, WINDOW, WINDOW + 1, 2 * WINDOW + 3)}
CONFIGS = [{}, {"num_key_value_heads": 4, "num_hidden_layers": 3}]


def gemma(seed: int, **config):
    """The tiny Gemma-3 with random norm weights (Gemma's start at zero, which would make its q- and
    k-norms, and its four norms per layer, indistinguishable)."""
    model = tiny_gemma3(VOCAB, seed=seed, **config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.normal_(0.0, 0.5)
    return model


def verify_once(model, prompt, tree, gemm, direct, rows_attention):
    """The prompt's prefill (all but its last token) and one verification forward of ``tree`` on the
    last one, through ``direct`` or the model's own forward; the model's own forwards attend as
    ``rows_attention`` says."""
    cache = preallocated_cache_for(model.config, 64)
    with torch.no_grad(), model_attention(model) if rows_attention else nullcontext():
        with gemm.rows() if gemm is not None else nullcontext():
            model(torch.tensor([prompt[:-1]]), **cache_kwargs(cache), use_cache=True)
        inputs = TreeInputBuffers(8, 64, torch.float32)
        out = verification_forward(
            model, cache, inputs, prompt[-1], tree, len(prompt) - 1, True, FastPaths(gemm, direct)
        )
    return out, cache


def assert_same(out, cache, reference, reference_cache, layers):
    assert torch.equal(out.logits, reference.logits)
    assert len(out.hidden_states) == len(reference.hidden_states) == layers + 1
    for ours, theirs in zip(out.hidden_states, reference.hidden_states, strict=True):
        assert torch.equal(ours, theirs)
    for ours, theirs in zip(cache.layers, reference_cache.layers, strict=True):
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)


@pytest.mark.parametrize("nodes", [0, 1, 6])
@pytest.mark.parametrize("length", list(PROMPTS))
@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("config", CONFIGS, ids=["gqa", "mha-3-layers"])
@pytest.mark.parametrize("rows_attention", [True, False], ids=["rows-attention", "sdpa"])
def test_the_gemma_forward_is_bitwise_the_models_forward(nodes, length, packed, config, rows_attention):
    model = gemma(nodes + length, **config)
    direct = direct_forward_for(model, rows_attention=rows_attention)
    assert isinstance(direct, GemmaDirectForward) and direct.rows_attention == rows_attention
    if packed and not linear_kernel_available("stream"):
        pytest.skip("the stream kernel does not run here")
    gemm = PackedGemm(model, "stream") if packed else None
    if gemm is not None:
        gemm.padded_rows(1)
    tree = seeded_random_tree(nodes, nodes + length, VOCAB) if nodes else DraftTree.empty()
    prompt = PROMPTS[length]
    reference, reference_cache = verify_once(model, prompt, tree, gemm, None, rows_attention)
    out, cache = verify_once(model, prompt, tree, gemm, direct, rows_attention)
    assert direct._steps  # the lean loop ran
    assert_same(out, cache, reference, reference_cache, model.config.num_hidden_layers)


def test_one_token_steps_across_the_window_are_the_models():
    """Plain decoding steps from below the window to past it: every step's logits and hidden states and
    the cache, bitwise the model's (its sliding layers start masking the oldest keys on the way)."""
    model = gemma(3)
    direct = direct_forward_for(model)
    runs = []
    for forward in (None, direct):
        cache = preallocated_cache_for(model.config, 64)
        steps = []
        with torch.no_grad(), model_attention(model):
            model(torch.tensor([PROMPTS[5][:-1]]), **cache_kwargs(cache), use_cache=True)
            for position in range(4, 3 * WINDOW):
                ids, positions = torch.tensor([[(position * 11) % VOCAB]]), torch.tensor([[position]])
                if forward is None:
                    out = model(
                        ids, position_ids=positions, **cache_kwargs(cache), use_cache=True, output_hidden_states=True
                    )
                else:
                    out = forward(ids, positions, None, cache, output_hidden_states=True)
                steps.append((out.logits, out.hidden_states))
        runs.append((steps, cache))
    (reference, reference_cache), (ours, cache) = runs
    for (logits, states), (their_logits, their_states) in zip(ours, reference, strict=True):
        assert torch.equal(logits, their_logits)
        assert all(torch.equal(a, b) for a, b in zip(states, their_states, strict=True))
    for a, b in zip(cache.layers, reference_cache.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_a_single_tree_mask_is_split_per_layer_type_as_the_runtime_splits_it():
    model = gemma(4)
    direct = direct_forward_for(model)
    prompt, tree = PROMPTS[2 * WINDOW + 3], seeded_random_tree(5, 4, VOCAB)
    reference, reference_cache = verify_once(model, prompt, tree, None, None, True)
    cache = preallocated_cache_for(model.config, 64)
    with torch.no_grad(), model_attention(model):
        model(torch.tensor([prompt[:-1]]), **cache_kwargs(cache), use_cache=True)
        mask, positions = TreeInputBuffers(8, 64, torch.float32).build(tree, len(prompt) - 1, 0)
        ids = torch.tensor([[prompt[-1], *tree.tokens.tolist()]])
        out = direct(ids, positions, mask, cache, output_hidden_states=True)
    assert_same(out, cache, reference, reference_cache, model.config.num_hidden_layers)


def test_the_sliding_layers_mask_matters_here():
    """The control: these prompts reach past the window, so a forward whose sliding layers saw every key
    would differ (the equality above is not the window's absence)."""
    model = gemma(1)
    direct = direct_forward_for(model)
    prompt = PROMPTS[2 * WINDOW + 3]
    tree = seeded_random_tree(6, 1, VOCAB)
    reference, _ = verify_once(model, prompt, tree, None, None, True)
    direct.window = 10**6  # one-row steps: no sliding mask
    step, _ = verify_once(model, prompt, DraftTree.empty(), None, direct, True)
    step_reference, _ = verify_once(model, prompt, DraftTree.empty(), None, None, True)
    assert not torch.equal(step.logits, step_reference.logits)
    model.config.sliding_window = 10**6  # trees: the mask per layer type sees every key
    out, _ = verify_once(model, prompt, tree, None, direct, True)
    assert not torch.equal(out.logits, reference.logits)


def test_generate_through_the_gemma_forward_equals_plain_decoding():
    model = gemma(2)
    prompt = PROMPTS[WINDOW + 1]
    for options in (KernelOptions(direct_forward=False), KernelOptions()):
        backends = Backends(options)
        assert (backends.kernels(model).direct() is not None) == options.direct_forward
        with backends.reference_forwards(model):
            reference = hf_greedy(model, prompt, 24)
        for drafter in (None, PromptLookupDrafter(num_draft=4)):
            result = generate(model, prompt, drafter, max_new_tokens=24, eos_token_ids=[2], backends=backends)
            assert result.tokens == reference


def test_gemma_forward_is_used_only_where_it_is_the_same():
    assert direct_forward_for(tiny_gemma3(VOCAB)) is not None
    for config in ({"final_logit_softcapping": 30.0}, {"attn_logit_softcapping": 50.0}, {"attention_bias": True}):
        assert direct_forward_for(tiny_gemma3(VOCAB, **config)) is None, config
    model = tiny_gemma3(VOCAB)
    handle = model.model.layers[0].mlp.register_forward_hook(lambda module, args, output: output * 2)
    assert direct_forward_for(model) is None
    handle.remove()
    model.train()
    assert direct_forward_for(model) is None


def test_the_plan_follows_weights_changed_in_place_or_replaced():
    model = gemma(7)
    direct = direct_forward_for(model)
    prompt = PROMPTS[WINDOW + 1]
    verify_once(model, prompt, DraftTree.empty(), None, direct, True)
    with torch.no_grad():
        model.model.layers[1].self_attn.k_norm.weight.add_(0.25)  # in place: the plan's 1 + weight is stale
        model.model.norm.weight.mul_(1.5)
    reference, _ = verify_once(model, prompt, DraftTree.empty(), None, None, True)
    out, _ = verify_once(model, prompt, DraftTree.empty(), None, direct, True)
    assert torch.equal(out.logits, reference.logits)
    layer = model.model.layers[0].mlp.up_proj
    layer.weight = torch.nn.Parameter(torch.randn_like(layer.weight))
    reference, _ = verify_once(model, prompt, DraftTree.empty(), None, None, True)
    out, _ = verify_once(model, prompt, DraftTree.empty(), None, direct, True)
    assert torch.equal(out.logits, reference.logits)
