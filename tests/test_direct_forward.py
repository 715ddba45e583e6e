"""The direct verification forward: bitwise the model's own forward (logits, hidden states, cache) on
one-token steps and tree forwards, packed or not, and used only where that holds."""

from contextlib import nullcontext

import pytest
import torch

from conftest import tiny_llama
from draftsmith.core.cache import preallocated_cache_for
from draftsmith.core.cache_kwarg import cache_kwargs
from draftsmith.core.tree import DraftTree, TreeInputBuffers
from draftsmith.inference.backends import Backends, FastPaths, verification_forward
from draftsmith.inference.kernels.attention import model_attention
from draftsmith.inference.kernels.direct import direct_forward_for
from draftsmith.inference.kernels.direct_forward import RotaryTable, _rotary_factors
from draftsmith.inference.kernels.options import KernelOptions
from draftsmith.inference.kernels.packed_gemm import PackedGemm
from draftsmith.inference.methods.pld import PromptLookupDrafter
from draftsmith.inference.runtime import generate
from helpers import hf_greedy, seeded_random_tree

VOCAB = 97
PROMPT = [5, 17, 33, 2, 61, 8, 40, 17, 33]


def verify_once(model, tree, gemm, direct, rows_attention=None):
    """The prompt's prefill and one verification forward of ``tree`` (``direct``: through it); the model's
    own forwards attend as ``direct`` does, or as ``rows_attention`` says (the row-invariant attention)."""
    cache = preallocated_cache_for(model.config, 64)
    rows = direct.rows_attention if direct is not None else rows_attention
    with torch.no_grad(), model_attention(model) if rows else nullcontext():
        model(torch.tensor([PROMPT[:-1]]), **cache_kwargs(cache), use_cache=True, output_hidden_states=True)
        inputs = TreeInputBuffers(8, 64, torch.float32)
        out = verification_forward(
            model, cache, inputs, PROMPT[-1], tree, len(PROMPT) - 1, True, FastPaths(gemm, direct)
        )
    return out, cache


@pytest.mark.parametrize("nodes", [0, 1, 3, 6])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("config", [{}, {"attention_bias": True, "mlp_bias": True, "num_key_value_heads": 4}])
@pytest.mark.parametrize("rows_attention", [True, False], ids=["rows-attention", "sdpa"])
def test_the_direct_forward_is_bitwise_the_models_forward(nodes, packed, config, rows_attention):
    model = tiny_llama(VOCAB, seed=nodes, **config)
    direct = direct_forward_for(model, rows_attention=rows_attention)
    assert direct is not None and direct.rows_attention == rows_attention
    if packed and not torch.backends.mkl.is_available():
        pytest.skip("PyTorch built without MKL")
    gemm = PackedGemm(model) if packed else None
    tree = seeded_random_tree(nodes, nodes, VOCAB) if nodes else DraftTree.empty()
    reference, reference_cache = verify_once(model, tree, gemm, None, rows_attention)
    out, cache = verify_once(model, tree, gemm, direct)
    assert torch.equal(out.logits, reference.logits)
    assert len(out.hidden_states) == len(reference.hidden_states) == model.config.num_hidden_layers + 1
    for ours, theirs in zip(out.hidden_states, reference.hidden_states):
        assert torch.equal(ours, theirs)
    for ours, theirs in zip(cache.layers, reference_cache.layers):
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)


@pytest.mark.parametrize("config", [{}, {"num_key_value_heads": 4}, {"attention_bias": True}])
def test_one_token_steps_take_the_short_path_where_it_applies(config):
    """Plain decoding steps of a bias-free Llama go through the one-token plan (bitwise the model's: the
    test above covers them); a layer with biases keeps the general path."""
    model = tiny_llama(VOCAB, **config)
    direct = direct_forward_for(model)
    reference, _ = verify_once(model, DraftTree.empty(), None, None, direct.rows_attention)
    out, _ = verify_once(model, DraftTree.empty(), None, direct)
    assert torch.equal(out.logits, reference.logits)
    assert bool(direct._steps) == ("attention_bias" not in config)


@pytest.mark.parametrize("force_gqa", ["0", "1"])
def test_tree_forwards_outside_the_runtime_take_the_wrappers_attention_branch(force_gqa, monkeypatch):
    """Without the runtime's grouped-K/V switch transformers repeats the K/V heads under a mask; with it
    SDPA reads them grouped. The lean path takes the same branch as the model either way (with SDPA: the
    row-invariant attention reads grouped heads under any mask)."""
    monkeypatch.setenv("TRANSFORMERS_SDPA_FORCE_GQA", force_gqa)
    model = tiny_llama(VOCAB, seed=8)
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    direct = direct_forward_for(model, rows_attention=False)
    tree = seeded_random_tree(5, 8, VOCAB)
    outputs = []
    for forward in (None, direct):
        cache = preallocated_cache_for(model.config, 64)
        with torch.no_grad():
            model(torch.tensor([PROMPT[:-1]]), **cache_kwargs(cache), use_cache=True)
            mask, positions = TreeInputBuffers(8, 64, torch.float32).build(tree, len(PROMPT) - 1, 0)
            ids = torch.tensor([[PROMPT[-1], *tree.tokens.tolist()]])
            if forward is None:
                out = model(ids, attention_mask=mask, position_ids=positions, **cache_kwargs(cache), use_cache=True)
            else:
                out = forward(ids, positions, mask, cache)
        outputs.append((out.logits, cache))
    assert direct._steps
    assert torch.equal(outputs[0][0], outputs[1][0])
    for ours, theirs in zip(outputs[1][1].layers, outputs[0][1].layers):
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)


def test_the_one_token_plan_follows_replaced_weights():
    model = tiny_llama(VOCAB, seed=7)
    direct = direct_forward_for(model)
    verify_once(model, DraftTree.empty(), None, direct)
    first = direct._steps
    layer = model.model.layers[0].mlp.up_proj
    layer.weight = torch.nn.Parameter(torch.randn_like(layer.weight))
    reference, _ = verify_once(model, DraftTree.empty(), None, None, direct.rows_attention)
    out, _ = verify_once(model, DraftTree.empty(), None, direct)
    assert direct._steps is not first
    assert torch.equal(out.logits, reference.logits)


def test_generate_through_the_direct_forward_equals_plain_decoding():
    model = tiny_llama(VOCAB)
    for direct in (False, True):
        backends = Backends(KernelOptions(direct_forward=direct))
        with backends.reference_forwards(model):
            reference = hf_greedy(model, PROMPT, 24)
        for drafter in (None, PromptLookupDrafter(num_draft=4)):
            result = generate(model, PROMPT, drafter, max_new_tokens=24, eos_token_ids=[2], backends=backends)
            assert result.tokens == reference


def test_the_direct_forward_is_used_only_where_it_is_the_same():
    model = tiny_llama(VOCAB)
    with torch.no_grad():  # transformers' own output-capturing hooks, inactive outside its forward
        model(torch.tensor([PROMPT]), output_hidden_states=True)
    assert direct_forward_for(model) is not None
    model.train()
    assert direct_forward_for(model) is None
    model.eval()
    handle = model.model.layers[1].mlp.register_forward_hook(lambda module, args, output: output * 2)
    assert direct_forward_for(model) is None  # a user's hook would be skipped
    handle.remove()
    assert direct_forward_for(model) is not None
    model.config._attn_implementation = "eager"  # other attention kernels round differently
    assert direct_forward_for(model) is None


def test_other_architectures_keep_their_own_forward(capsys):
    from transformers import MistralConfig, MistralForCausalLM

    from draftsmith.inference.kernels import context

    mistral = MistralForCausalLM(
        MistralConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    ).eval()
    assert direct_forward_for(mistral) is None
    reference = hf_greedy(mistral, PROMPT, 12)
    context._say_once.cache_clear()  # said once per process: another test may have said it already
    for drafter in (None, PromptLookupDrafter(num_draft=4)):
        assert generate(mistral, PROMPT, drafter, max_new_tokens=12, eos_token_ids=[2]).tokens == reference
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and "MistralForCausalLM decodes through its own forward" in said[0]


@pytest.mark.parametrize("config", [{}, {"hidden_size": 256, "head_dim": 64}, {"hidden_size": 72, "head_dim": 18}])
def test_the_rotary_tables_rows_are_the_modules_floats(config):
    """Every position's row, looked up alone, in a tree's positions or past the table's first length, is
    bitwise what the rotary embedding computes for it (head sizes below, at and off a vector's width)."""
    model = tiny_llama(VOCAB, **config)
    rotary, x = model.model.rotary_emb, torch.zeros(1, 1, model.config.hidden_size)
    table = RotaryTable()
    alone = [torch.tensor([[p]]) for p in range(0, 700, 7)]
    for positions in [*alone, torch.tensor([[3, 4, 4, 5, 6, 5]]), torch.tensor([[1000, 1001, 1001]]), alone[1]]:
        cos, signed_sin = table.factors(rotary, x, positions)
        expected_cos, expected_sin = _rotary_factors(rotary(x, position_ids=positions))
        assert torch.equal(cos, expected_cos) and torch.equal(signed_sin, expected_sin)


def test_the_rotary_table_follows_its_module():
    """Inverse frequencies changed in place, a new module, and a rotary type whose factors depend on the
    positions asked for (computed by the module every time)."""
    model = tiny_llama(VOCAB)
    x, positions = torch.zeros(1, 1, model.config.hidden_size), torch.tensor([[9, 10, 10]])
    table = RotaryTable()

    def same(rotary) -> bool:
        cos, signed_sin = table.factors(rotary, x, positions)
        expected_cos, expected_sin = _rotary_factors(rotary(x, position_ids=positions))
        return torch.equal(cos, expected_cos) and torch.equal(signed_sin, expected_sin)

    rotary = model.model.rotary_emb
    assert same(rotary)
    rotary.inv_freq.mul_(1.5)
    assert same(rotary)
    other = type(rotary)(model.config.__class__(**{**model.config.to_dict(), "rope_theta": 500.0}))
    assert same(other) and same(rotary)
    calls = []
    rotary.rope_type = "dynamic"
    real = rotary.forward
    rotary.forward = lambda *a, **k: calls.append(1) or real(*a, **k)
    assert same(rotary) and same(rotary) and len(calls) == 4  # two looked up, two references


def test_the_native_layers_follow_packs_taken_over_by_another_gemm():
    """A second PackedGemm over the same model takes its linears (with other kernels' floats): the C++
    layers multiply by the packs of the gemm now in use, not by those they read before."""
    from draftsmith.inference.kernels.packed_gemm import linear_kernel_available

    if not (linear_kernel_available("stream") and linear_kernel_available("onednn")):
        pytest.skip("the stream and oneDNN kernels do not both run here")
    model = tiny_llama(VOCAB, seed=4)
    direct = direct_forward_for(model)
    assert direct.native
    tree = seeded_random_tree(3, 4, VOCAB)
    for kernel in ("stream", "onednn", "stream"):
        gemm = PackedGemm(model, kernel)
        for change in (1.0, -1.5):  # then a weight changed in place: the gemm packs it again
            with torch.no_grad():
                model.model.layers[0].mlp.up_proj.weight.mul_(change)
            with gemm.model_forwards():
                reference, _ = verify_once(model, tree, gemm, None, rows_attention=True)
                out, _ = verify_once(model, tree, gemm, direct)
            assert torch.equal(out.logits, reference.logits), (kernel, change)
