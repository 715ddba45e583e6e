"""Draft-model speculative decoding: greedy identity with HF generate, the drafter's KV cache, lossless
sampled chains (chi-square against the exact distribution), tokenizer refusal and ``layers:N``."""

import json
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from conftest import SHARED_DATA, tiny_llama
from draftsmith.core.cache_kwarg import cache_kwargs
from draftsmith.core.drafting import Drafter
from draftsmith.core.target import Target, TargetError
from draftsmith.inference.methods.draft_model import (
    DraftModelDrafter,
    build_draft_model_drafter,
    build_truncated_draft,
    tokenizer_mismatch,
)
from draftsmith.inference.methods.errors import MethodError
from draftsmith.inference.methods.table import build_drafter
from draftsmith.inference.runtime import generate
from helpers import (
    N_SAMPLES,
    SAMPLING_VOCAB,
    chi_square_p_value,
    exact_distribution,
    hf_greedy,
    repetitive_prompts,
    sample_counts,
)
from helpers import SAMPLING_CONFIGS as CONFIGS

SPEC_BENCH = SHARED_DATA / "spec_bench_dev.jsonl"
VOCAB = 97


def prompts(n, seed=0):
    return repetitive_prompts(n, seed, VOCAB)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(VOCAB, seed=0)


def drafter_for(model, kind: str, num_draft: int = 4, **kwargs) -> DraftModelDrafter:
    draft = {
        "other": lambda: tiny_llama(VOCAB, seed=1),
        "padded": lambda: tiny_llama(VOCAB + 31, seed=2),  # same tokens, lm_head padded wider than the target's
        "narrow": lambda: tiny_llama(VOCAB - 7, seed=2),  # a draft that cannot say the last 7 ids
        "self": lambda: model,
        "layers:1": lambda: build_truncated_draft(model, 1),
    }[kind]()
    return DraftModelDrafter(draft, VOCAB, num_draft, **kwargs)


@pytest.mark.parametrize("kind", ["other", "padded", "narrow", "self", "layers:1"])
def test_greedy_output_is_identical_to_hf_generate(model, kind):
    drafter = drafter_for(model, kind)  # one drafter across prompts: a new prompt must reset its cache
    for prompt in prompts(8, seed=5):
        truth = hf_greedy(model, prompt, 64, eos=())
        result = generate(model, prompt, drafter, max_new_tokens=64)
        assert result.tokens == truth
        if kind == "self":  # the target drafting for itself: every draft accepted, plus the bonus token
            assert all(length == drafter.num_draft + 1 for length in result.accept_lengths)


@pytest.mark.parametrize("stop_at_eos", [False, True])
@pytest.mark.parametrize("max_new_tokens", [1, 3, 10, 11, 17])
def test_eos_and_budget_inside_a_fully_accepted_chain(model, stop_at_eos, max_new_tokens):
    prompt = prompts(2)[1]
    truth = hf_greedy(model, prompt, 30, eos=())
    eos = truth[9]  # a token the target really produces: generation stops right after it
    drafter = drafter_for(model, "self", num_draft=4, stop_token_ids=(eos,) if stop_at_eos else ())
    result = generate(model, prompt, drafter, max_new_tokens=max_new_tokens, eos_token_ids=[eos])
    assert result.tokens == hf_greedy(model, prompt, max_new_tokens, eos=[eos])


class CheckedDrafter(Drafter):
    """Wraps a DraftModelDrafter and, after every round, compares its KV cache with a fresh prefill of
    the tokens it claims to hold."""

    name = "checked"

    def __init__(self, inner: DraftModelDrafter):
        self.inner, self.rounds, self.rollbacks, self.committed = inner, 0, 0, []

    def propose(self, context):
        before = list(self.inner.cached_tokens)
        tree = self.inner.propose(context)
        cached = self.inner.cached_tokens
        # exactly the committed context plus this round's drafts but the last (never fed): nothing stale
        assert cached == context.tokens + tree.tokens.tolist()[:-1]
        if before != cached[: len(before)]:  # rejected drafts or another prompt cut back here
            self.rollbacks += 1
        assert_cache_matches_prefill(self.inner.model, self.inner.cache, cached)
        self.rounds += 1
        self.committed = context.tokens
        return tree

    def observe(self, tree, logits, verdict):  # only called by runtimes with the observe hook
        before = len(self.inner.cached_tokens)
        self.inner.observe(tree, logits, verdict)
        self.rollbacks += len(self.inner.cached_tokens) < before  # rejected drafts dropped at once
        accepted = [int(tree.tokens[i]) for i in verdict.accepted_nodes]
        assert self.committed + accepted[: len(self.inner.cached_tokens) - len(self.committed)] == (
            self.inner.cached_tokens
        )


def assert_cache_matches_prefill(draft, cache, tokens):
    fresh = DynamicCache(config=draft.config)
    with torch.no_grad():
        draft(torch.tensor([tokens]), **cache_kwargs(fresh), use_cache=True)
    assert len(cache.layers) == len(fresh.layers)
    for ours, theirs in zip(cache.layers, fresh.layers):
        assert ours.keys.shape == theirs.keys.shape
        torch.testing.assert_close(ours.keys, theirs.keys, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(ours.values, theirs.values, rtol=1e-4, atol=1e-5)


def test_draft_cache_equals_a_fresh_prefill_of_committed_tokens(model):
    checked = CheckedDrafter(drafter_for(model, "other", num_draft=3))
    first = prompts(3, seed=9)
    # the second prompt shares the first one's beginning (the cache is cut back to the shared part),
    # the third shares nothing (the cache starts over)
    for prompt in [first[0], first[0][:4] + first[1], first[2]]:
        truth = hf_greedy(model, prompt, 40, eos=())
        assert generate(model, prompt, checked, max_new_tokens=40).tokens == truth
    assert checked.rounds > 10 and checked.rollbacks > 3  # more than the two prompt switches


@pytest.fixture(scope="module")
def sampling_model():
    """test_sampling's peaked 5-token model (enumerable exactly)."""
    model = tiny_llama(SAMPLING_VOCAB, seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def sampling_draft(sampling_model, kind):
    if kind == "layers:1":
        return build_truncated_draft(sampling_model, 1)
    draft = tiny_llama(SAMPLING_VOCAB, seed=4)
    with torch.no_grad():  # peaked and different from the target: many rejections and residual samples
        draft.lm_head.weight.mul_(6.0)
    return draft


@pytest.mark.parametrize(
    "kind, config", [("other", CONFIGS[1]), ("layers:1", CONFIGS[0])], ids=["other-t0.7-k4-p0.9", "layers1-t1"]
)
def test_sampled_chains_match_the_exact_distribution(sampling_model, kind, config):
    drafter = DraftModelDrafter(sampling_draft(sampling_model, kind), SAMPLING_VOCAB, num_draft=2)
    counts = sample_counts(sampling_model, drafter, config, seed=13)
    assert chi_square_p_value(counts, exact_distribution(sampling_model, config), N_SAMPLES) > 1e-3


def test_sampled_chain_carries_q_padded_to_the_target_vocab(model):
    from draftsmith.core.drafting import DraftContext

    drafter = drafter_for(model, "narrow", num_draft=3)
    context = DraftContext(prompts(1)[0], 5, CONFIGS[1], torch.Generator().manual_seed(0))
    tree = drafter.propose(context)
    q = tree.draft_dists
    assert q.shape == (3, VOCAB) and torch.allclose(q.sum(-1), torch.ones(3))
    assert (q[:, VOCAB - 7 :] == 0).all() and all(q[i, t] > 0 for i, t in enumerate(tree.tokens.tolist()))
    assert (q > 0).sum(-1).max() <= CONFIGS[1].top_k  # q went through the same top-k as the target


def save_tiny(path: Path, tokenizer, seed: int) -> Path:
    model = tiny_llama(len(tokenizer), seed=seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_a_draft_with_another_tokenizer_is_refused_in_one_line(tmp_path, tiny_target_dir, llama3_tokenizer, capsys):
    from draftsmith.cli import main

    draft_dir = save_tiny(tmp_path / "llama3-draft", llama3_tokenizer, seed=5)
    args = ["generate", "hi", "--target", str(tiny_target_dir), "--method", f"draft={draft_dir}"]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("draftsmith: error:")]
    assert len(errors) == 1 and "Traceback" not in err
    assert "tokenizer's special token eos_token differs" in errors[0] and "use a draft model trained" in errors[0]


def test_tokenizer_mismatch_names_a_vocabulary_difference(tokenizer):
    from conftest import make_tokenizer

    other = make_tokenizer()
    assert tokenizer_mismatch(tokenizer, other) is None
    other.add_tokens(["<extra-token>"])
    assert "vocabulary differs" in tokenizer_mismatch(tokenizer, other)


def test_draft_method_from_a_directory_and_layers_in_the_cli(tiny_target_dir, other_target_dir, capsys):
    from draftsmith.cli import main

    outputs = {}
    for method in ["none", f"draft={other_target_dir}", "draft=layers:1:k=3"]:
        main(["generate", "What is the capital of France?", "--target", str(tiny_target_dir), "--method", method])
        captured = capsys.readouterr()
        outputs[method] = captured.out
        assert f"[{method}]" in captured.err
    assert len(set(outputs.values())) == 1 and outputs["none"].strip()


@pytest.mark.parametrize(
    "spec, message",
    [
        ("draft", "the draft method needs a model"),
        ("draft=layers:0", "layers:N needs 1 <= N < 2"),
        ("draft=layers:2", "layers:N needs 1 <= N < 2"),
        ("draft=layers:two", "layers:N needs a whole number"),
        ("draft=layers:1:k=0", "at least 1"),
    ],
)
def test_bad_draft_arguments_are_method_errors(model, tokenizer, spec, message):
    target = Target(model, tokenizer, identity=None)
    with pytest.raises(MethodError, match=message):
        build_drafter(spec, target)


def test_truncated_draft_shares_the_targets_weights(model):
    draft = build_truncated_draft(model, 1)
    assert draft.config.num_hidden_layers == 1 and model.config.num_hidden_layers == 2
    assert draft.model.layers[0] is model.model.layers[0] and draft.lm_head is model.lm_head
    assert draft.model.embed_tokens is model.model.embed_tokens and draft.model.norm is model.model.norm
    ids = torch.tensor([prompts(1)[0]])
    with torch.no_grad():  # by hand: embed, first layer, final norm, lm_head
        hidden = model(ids, output_hidden_states=True).hidden_states[1]
        torch.testing.assert_close(draft(ids).logits, model.lm_head(model.model.norm(hidden)))


def test_a_model_without_decoder_layers_cannot_be_truncated():
    with pytest.raises(TargetError, match="needs a decoder-only model"):
        build_truncated_draft(torch.nn.Linear(2, 2), 1)


@pytest.mark.slow
@pytest.mark.skipif(not SPEC_BENCH.is_file(), reason="Spec-Bench dev questions not present")
def test_smollm2_truncated_draft_is_identical_to_hf_greedy():
    from draftsmith.core.target import load_target

    target = load_target()
    drafter = build_draft_model_drafter(target, "layers:26:k=2")  # agrees with the target ~40% of the time
    questions = [json.loads(line) for line in SPEC_BENCH.read_text().splitlines()[::48][:5]]
    eos, accepted = target.eos_token_ids, 0
    for question in questions:
        prompt = target.encode_chat([{"role": "user", "content": question["turns"][0]}])
        truth = hf_greedy(target.model, prompt, 40, eos=eos)
        result = generate(target.model, prompt, drafter, max_new_tokens=40, eos_token_ids=eos)
        assert result.tokens == truth
        accepted += sum(result.accept_lengths) - len(result.accept_lengths)
    assert accepted > 0  # the accepted-draft path was exercised on the real model, not only rejections


def test_a_draft_smaller_than_the_tokenizer_is_refused(tmp_path, tiny_target_dir, tokenizer):
    from draftsmith.core.target import load_target

    small = tmp_path / "small-draft"
    tiny_llama(len(tokenizer) - 10, seed=6).save_pretrained(small)
    tokenizer.save_pretrained(small)
    with pytest.raises(TargetError, match="fewer vocabulary rows than the tokenizer's"):
        build_draft_model_drafter(load_target(str(tiny_target_dir)), str(small))
