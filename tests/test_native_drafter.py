"""A feature drafter's decoder layer through the C++ extension (kernels/native_drafter.py): the module's
own forward within float32 rounding over a drafter's steps (a catch-up, then tree expansions under their
masks; the cache included), through the drafter's packs too; declined where it cannot serve; decoding
with it stays plain greedy decoding, and the runtime really runs it. EAGLE-3's whole drafting step in
one call: bitwise the layer kernel's path with the modules' fc, norms and head around it."""

import pytest
import torch
from transformers import DynamicCache

from conftest import tiny_llama
from draftsmith.core.cache import PreallocatedCache
from draftsmith.core.tree import causal_mask_after
from draftsmith.drafters.registry import get_family
from draftsmith.inference.backends import Backends
from draftsmith.inference.kernels.native import native_extension
from draftsmith.inference.kernels.native_drafter import NativeDrafterLayer
from draftsmith.inference.kernels.packed_gemm import PackedGemm
from draftsmith.inference.runtime import generate
from helpers import hf_greedy, random_prompts, serve

VOCAB = 97
LAYERS = [0, 2, 3]
FAMILIES = ["eagle", "fspad", "eagle3", "fspad3"]

pytestmark = pytest.mark.skipif(native_extension() is None, reason="the C++ extension does not build here")


@pytest.fixture(scope="module")
def target():
    return tiny_llama(VOCAB, seed=0, num_hidden_layers=5)


def drafter_model(family, target):
    torch.manual_seed(1)
    options = {"aux_layer_ids": LAYERS} if family.endswith("3") else {}
    return get_family(family).build(target.config, options).eval()


class Counting:
    """A layer kernel that counts the calls it served (layers and whole drafting steps)."""

    def __init__(self, kernel):
        self.kernel, self.served, self.steps = kernel, 0, 0

    def __call__(self, *args):
        done = self.kernel(*args)
        self.served += done is not None
        return done

    def step(self, *args):
        done = self.kernel.step(*args)
        self.steps += done is not None
        return done


def drafter_steps(model, kernel, feature_width):
    """A catch-up over 6 committed rows, then two tree expansions (3 rows, then 2) whose rows see the
    committed rows, some earlier tree rows and themselves: every output, and the cache."""
    generator = torch.Generator().manual_seed(3)
    h = model.config.layer_config().hidden_size
    cache = PreallocatedCache(1, 4)  # grows on the way
    outputs = []
    lowest = torch.finfo(torch.float32).min

    def inputs(rows):
        return torch.randn(1, rows, h, generator=generator), torch.randn(1, rows, feature_width, generator=generator)

    embeds, features = inputs(6)
    mask = causal_mask_after(0, 6, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        outputs.append(model.read_target(embeds, features, torch.arange(6)[None], mask, cache, kernel=kernel))
        for rows, seen in ((3, [(2, 6)]), (2, [(0, 7), (1, 8)])):
            past = 6 + (3 if rows == 2 else 0)
            mask = torch.full((1, 1, rows, past + rows), lowest)
            mask[..., :6] = 0
            for row in range(rows):
                mask[0, 0, row, past + row] = 0
            for row, column in seen:
                mask[0, 0, row, column] = 0
            embeds, hidden = inputs(rows)
            hidden = hidden[..., :h]
            outputs.append(model(embeds, hidden, torch.full((1, rows), past), mask, cache, kernel=kernel))
    return outputs, cache


def feature_width(model):
    return model.fc.in_features - (model.config.layer_config().hidden_size if not hasattr(model, "layer") else 0)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("packed", [False, True])
def test_the_native_layer_is_the_modules_forward_within_rounding(target, family, packed):
    model = drafter_model(family, target)
    kernel = Counting(NativeDrafterLayer(native_extension()))
    width = feature_width(model)
    gemm = PackedGemm(model, "stream") if packed else None
    if gemm is not None:
        gemm.padded_rows(1)
    with gemm.rows() if gemm is not None else torch.no_grad():
        ours, our_cache = drafter_steps(model, kernel, width)
    theirs, their_cache = drafter_steps(model, None, width)
    assert kernel.served == 3
    for mine, reference in zip(ours, theirs, strict=True):
        for name in ("token_features", "next_features"):
            torch.testing.assert_close(getattr(mine, name), getattr(reference, name), atol=2e-5, rtol=1e-4)
    mine, reference = our_cache.layers[0], their_cache.layers[0]
    assert mine.length == reference.length == 11
    torch.testing.assert_close(mine.keys, reference.keys, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(mine.values, reference.values, atol=2e-5, rtol=1e-4)


def test_the_kernel_declines_what_it_cannot_serve_and_touches_nothing(target):
    model = drafter_model("eagle3", target)
    layer = model.layer
    kernel = NativeDrafterLayer(native_extension())
    h = model.config.layer_config().hidden_size
    rotary = model.rotary_emb(torch.zeros(1, 2, h), torch.arange(2)[None])
    inputs = (torch.randn(1, 2, 2 * h), torch.randn(1, 2, h), rotary)
    parts = (layer.self_attn, layer.post_attention_layernorm, layer.mlp)
    cache = PreallocatedCache(1, 8)
    with torch.enable_grad():  # training: autograd needs the module's forward
        assert kernel(*parts, *inputs, None, cache) is None
    with torch.no_grad():
        assert kernel(*parts, *inputs, None, DynamicCache()) is None  # not a preallocated cache
        biased = drafter_model("eagle3", target)
        biased.layer.mlp.down_proj.bias = torch.nn.Parameter(torch.zeros(biased.layer.mlp.down_proj.out_features))
        parts = (biased.layer.self_attn, biased.layer.post_attention_layernorm, biased.layer.mlp)
        assert kernel(*parts, *inputs, None, cache) is None
        assert kernel(*(layer.self_attn, layer.post_attention_layernorm, layer.mlp), *inputs, None, cache) is not None
    assert cache.layers[0].length == 2  # the declined calls wrote nothing


@pytest.mark.parametrize("family", ["fspad", "eagle3"])
def test_decoding_through_the_native_layer_is_plain_greedy_decoding(target, family, monkeypatch):
    model = drafter_model(family, target)
    backends = Backends()
    counting = Counting(backends.drafter_layer_kernel())
    monkeypatch.setattr(backends, "drafter_layer_kernel", lambda: counting)
    drafter = serve(model, target, depth=3, top_k=2, total_tokens=6)
    for prompt in random_prompts(4, 5, VOCAB):
        assert generate(target, prompt, drafter, max_new_tokens=24, backends=backends).tokens == hf_greedy(
            target, prompt, 24
        )
    assert counting.served + counting.steps > 20  # every round's catch-up and expansions went through it
    assert (counting.steps > 0) == (model.drafting_step(True) is not None)


def whole_steps(model, kernel, fused: bool, top_k: int = 3):
    """drafter_steps' catch-up and expansions as the runtime drafter makes them: through the kernel's whole
    step (``fused``), or through the model's forward with the kernel's layer and then its head; per step
    (features, top log-probabilities, their columns), and the cache."""
    generator = torch.Generator().manual_seed(3)
    h = model.config.layer_config().hidden_size
    width = len(model.config.aux_layer_ids) * h
    cache = PreallocatedCache(1, 4)
    lowest = torch.finfo(torch.float32).min
    steps = [(6, True, causal_mask_after(0, 6, torch.float32, torch.device("cpu")), 1)]
    for rows, past in ((3, 6), (2, 9)):
        mask = torch.full((1, 1, rows, past + rows), lowest)
        mask[..., :6] = 0
        mask[0, 0, torch.arange(rows), past + torch.arange(rows)] = 0
        steps.append((rows, False, mask, rows))
    out = []
    with torch.no_grad():
        for rows, from_target, mask, logit_rows in steps:
            embeds = torch.randn(1, rows, h, generator=generator)
            hidden = torch.randn(1, rows, width if from_target else h, generator=generator)
            positions = torch.arange(rows)[None] if from_target else torch.full((1, rows), mask.shape[-1] - rows)
            if fused:
                step = model.drafting_step(from_target)
                out.append(kernel.step(step, embeds, hidden, positions, mask, cache, logit_rows, top_k))
                continue
            forward = model.read_target if from_target else model
            features = forward(embeds, hidden, positions, mask, cache, kernel=kernel).token_features[0]
            top = model.logits(features[-logit_rows:]).log_softmax(-1).topk(top_k)
            out.append((features, top.values, top.indices))
    return out, cache


@pytest.mark.parametrize("packed", [False, True])
def test_eagle3s_whole_step_is_bitwise_the_layer_kernels_path(target, packed):
    model = drafter_model("eagle3", target)
    kernel = Counting(NativeDrafterLayer(native_extension()))
    gemm = PackedGemm(model, "stream") if packed else None
    if gemm is not None:
        gemm.padded_rows(1)
    with gemm.rows() if gemm is not None else torch.no_grad():
        ours, our_cache = whole_steps(model, kernel, fused=True)
        theirs, their_cache = whole_steps(model, kernel, fused=False)
    assert kernel.steps == 3 and kernel.served == 3
    for mine, reference in zip(ours, theirs, strict=True):
        for a, b in zip(mine, reference, strict=True):
            assert torch.equal(a, b)
    assert torch.equal(our_cache.layers[0].keys, their_cache.layers[0].keys)
    assert torch.equal(our_cache.layers[0].values, their_cache.layers[0].values)


def test_only_eagle3_offers_its_whole_step_and_the_kernel_declines_a_biased_head(target):
    for family in ("eagle", "fspad", "fspad3"):
        assert drafter_model(family, target).drafting_step(True) is None
    model = drafter_model("eagle3", target)
    assert model.drafting_step(False).fc is None and model.drafting_step(True).fc is model.fc
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(model.lm_head.out_features))
    h = model.config.layer_config().hidden_size
    cache = PreallocatedCache(1, 8)
    with torch.no_grad():
        step = model.drafting_step(False)
        declined = NativeDrafterLayer(native_extension()).step(
            step, torch.randn(1, 2, h), torch.randn(1, 2, h), torch.arange(2)[None], None, cache, 2, 3
        )
    assert declined is None
    assert not cache.layers or cache.layers[0].length == 0  # nothing written
