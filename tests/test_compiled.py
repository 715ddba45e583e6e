"""The compiled verification forward (``--compile``): bucketed static shapes whose padding changes no
committed token, checked against HF greedy decoding on a tiny random Llama."""

import random

import pytest
import torch

from conftest import tiny_llama
from draftsmith.core.drafting import Drafter
from draftsmith.core.tree import DraftTree, tree_attention_inputs
from draftsmith.inference.backends import Backends
from draftsmith.inference.kernels.compiled import (
    CompiledTarget,
    StaticTreeInputs,
    commit_static,
    context_bucket,
    tree_bucket,
)
from draftsmith.inference.kernels.options import KernelOptions
from draftsmith.inference.runtime import generate
from helpers import hf_greedy

VOCAB = 97


@pytest.fixture(scope="module")
def model():
    return tiny_llama(VOCAB, seed=0)


class TruthPlusNoiseDrafter(Drafter):
    """Trees of 0-12 nodes (so several buckets) holding a random prefix of the true continuation among
    random branches: accepted paths skip nodes, so committing moves rows."""

    name = "truth+noise"

    def __init__(self, truth: list[int], prompt_length: int, seed: int = 0) -> None:
        self.truth, self.prompt_length, self.rng = truth, prompt_length, random.Random(seed)

    def propose(self, context) -> DraftTree:
        upcoming = self.truth[len(context.tokens) - self.prompt_length :][: self.rng.randint(0, 5)]
        noise = [
            [self.rng.randrange(VOCAB) for _ in range(self.rng.randint(1, 3))] for _ in range(self.rng.randint(0, 3))
        ]
        return DraftTree.from_paths([path for path in noise if path[:1] != upcoming[:1]] + [upcoming])


def test_buckets():
    assert [tree_bucket(q) for q in (1, 2, 4, 5, 16, 17, 64, 65, 130)] == [1, 4, 4, 8, 16, 32, 64, 128, 192]
    assert [context_bucket(r) for r in (1, 256, 257, 1000, 5000)] == [256, 256, 512, 1024, 8192]


def test_static_inputs_match_the_eager_mask_and_hide_padding():
    rng = random.Random(0)
    inputs = StaticTreeInputs(64, torch.float32, torch.device("cpu"))
    for past in (3, 3, 9, 20):  # the same past twice, then growing: the buffer is reused
        size = rng.randint(0, 9)
        tree = DraftTree(
            torch.tensor([rng.randrange(VOCAB) for _ in range(size)]),
            torch.tensor([rng.randrange(-1, i) for i in range(size)]),
        )
        tokens, mask, positions = inputs.build(5, tree, past)
        q, bucket = size + 1, tree_bucket(size + 1)
        reference_mask, reference_positions = tree_attention_inputs(tree, past, torch.float32)
        assert tokens.shape == positions.shape == (1, bucket) and mask.shape == (1, 1, bucket, 64)
        assert tokens[0, 0] == 5 and torch.equal(tokens[0, 1:q], tree.tokens)
        assert torch.equal(mask[:, :, :q, : past + q], reference_mask)
        assert torch.equal(positions[:, :q], reference_positions)
        blocked = torch.finfo(torch.float32).min
        assert (mask[0, 0, :q, past + q :] == blocked).all()  # no real row sees padding or stale rows
        for row in range(q, bucket):  # a padding row sees itself only
            visible = (mask[0, 0, row] == 0).nonzero().flatten().tolist()
            assert visible == list(range(past)) + [past + row]


def test_commit_static_moves_the_accepted_rows(model):
    compiled = CompiledTarget(model, backend="aot_eager")
    cache = compiled.new_cache(40)
    keys = torch.randn(1, 2, 30, 8)
    for layer in cache.layers:
        layer.lazy_initialization(keys, keys)
        layer.keys[:, :, :30] = keys
        layer.values[:, :, :30] = keys + 1
    commit_static(cache, 10, [0, 2, 5])  # node i sits at row 11 + i
    for layer in cache.layers:
        expected = torch.cat([keys[:, :, :12], keys[:, :, [13, 16]]], 2)
        assert torch.equal(layer.keys[:, :, :14], expected)
        assert torch.equal(layer.values[:, :, :14], expected + 1)
        assert int(layer.cumulative_length) == 14


def test_padded_buckets_commit_exactly_the_plain_greedy_tokens(model):
    """aot_eager keeps this fast: it runs the same bucketed, padded, static-cache forwards as inductor."""
    backends = Backends(KernelOptions(compiled=True), compile_backend="aot_eager")
    rng = random.Random(1)
    for prompt_length in (5, 40):
        prompt = [rng.randrange(4, VOCAB) for _ in range(prompt_length)]
        truth = hf_greedy(model, prompt, 60, eos=())
        for drafter in (None, TruthPlusNoiseDrafter(truth, len(prompt))):
            result = generate(model, prompt, drafter, max_new_tokens=60, backends=backends)
            assert result.tokens == truth
    compiled = backends.compiled(model)
    assert result.tau > 1.3  # trees were accepted, so padded buckets and row moves were exercised
    assert {bucket for bucket, _ in compiled.compiled_shapes} >= {1, 4, 8}
    assert compiled.compile_seconds > 0


def test_inductor_compiled_forward_is_lossless(model):
    backends = Backends(KernelOptions(compiled=True))
    prompt = [5, 9, 11, 30, 41]
    truth = hf_greedy(model, prompt, 24, eos=())
    first = generate(model, prompt, None, max_new_tokens=24, backends=backends)
    second = generate(model, prompt, None, max_new_tokens=24, backends=backends)
    assert first.tokens == second.tokens == truth
    assert first.compile_seconds > 0 and second.compile_seconds == 0  # compiled once, then reused


def test_bench_compile_and_the_static_compiled_hf_baseline(tmp_path, tiny_target_dir):
    import json

    from draftsmith.cli import main

    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "writing", "turns": ["Say a b a b a b."]}) + "\n")
    out = tmp_path / "bench"
    main(
        ["bench", "--questions", str(questions), "--methods", "pld,hf-static-compile", "--max-new-tokens", "10"]
        + ["--target", str(tiny_target_dir), "--compile", "--out", str(out)]
    )
    results = json.loads((out / "results.json").read_text())
    assert results["compiled"] and results["compile_seconds"] > 0 and results["hf-static-compile_compile_seconds"] > 0
    for method in ["hf-generate", "none", "pld", "hf-static-compile"]:
        overall = results["methods"][method]["overall"]
        assert overall["total"] == 1 and overall["identical"] == 1, method
    assert results["methods"]["hf-static-compile"]["overall"]["tau"] == 1.0
    assert "compiled" in (out / "results.md").read_text()


class FeatureRecorder(TruthPlusNoiseDrafter):
    """A feature drafter's view: records the target features the runtime hands it each round."""

    wants_features = True

    def __init__(self, truth: list[int], prompt_length: int, layers: tuple[int, ...]) -> None:
        super().__init__(truth, prompt_length)
        self.feature_layers = layers
        self.seen: list[torch.Tensor] = []

    def propose(self, context) -> DraftTree:
        assert context.features.shape[0] == len(context.tokens) - 1
        self.seen.append(context.features[-1].clone())
        return super().propose(context)


@pytest.mark.parametrize("layers", [(-1,), (1, 2, -2)], ids=["lm-head-input", "fused-layers"])
def test_feature_drafters_get_the_same_features_from_the_compiled_forward(model, layers):
    """EAGLE-2 reads the lm_head input, EAGLE-3 several layers' states: both come out of the padded,
    compiled forward exactly as out of the eager one."""
    prompt = [7, 3, 9, 12, 40, 41, 5]
    truth = hf_greedy(model, prompt, 30, eos=())
    eager, compiled = FeatureRecorder(truth, len(prompt), layers), FeatureRecorder(truth, len(prompt), layers)
    assert generate(model, prompt, eager, max_new_tokens=30).tokens == truth
    backends = Backends(KernelOptions(compiled=True), compile_backend="aot_eager")
    result = generate(model, prompt, compiled, max_new_tokens=30, backends=backends)
    assert result.tokens == truth and len(eager.seen) == len(compiled.seen)
    assert eager.seen[0].shape[-1] == len(layers) * model.config.hidden_size
    for ours, reference in zip(compiled.seen, eager.seen):
        torch.testing.assert_close(ours, reference)
