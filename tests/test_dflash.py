"""DFlash drafters: one drafter forward per round, the runtime's block equals the training blocks, a
block sees the target's context before its anchor and nothing after (nor other blocks), the context
is really read, and a short self-distillation gets drafts accepted losslessly."""

import pytest
import torch

from conftest import tiny_llama
from draftsmith.drafters.base import FrozenTarget, TreeOptionError
from draftsmith.drafters.dflash import DFlashConfigError
from draftsmith.drafters.engine_layouts import EngineLayoutError
from draftsmith.drafters.registry import get_family
from draftsmith.inference.runtime import generate
from draftsmith.train.batch import TrainBatch
from draftsmith.train.losses import family_loss
from draftsmith.train.losses.dflash import _dflash_block_forward, dflash_mask, sample_anchors
from helpers import (
    assert_one_drafter_forward_per_round,
    fused_batch,
    hf_greedy,
    random_prompts,
    row_invariant_backends,
    serve,
    train_from_target,
)

VOCAB = 97
EOS = 2
LAYERS = [0, 2, 3]  # the states entering layers 0, 2 and 3 of the 5-layer target
BLOCK = 4
DFLASH = get_family("dflash")
OPTIONS = {"aux_layer_ids": LAYERS, "block_size": BLOCK, "num_layers": 2}


@pytest.fixture(scope="module")
def target():
    return tiny_llama(VOCAB, seed=0, num_hidden_layers=5)


@pytest.fixture(scope="module")
def batch(target):
    return fused_batch(target, VOCAB, LAYERS, n=12, new_tokens=32)


def build(target, **options):
    torch.manual_seed(0)
    return DFLASH.build(target.config, {**OPTIONS, **options})


@pytest.fixture(scope="module")
def trained(target, batch):
    return train_from_target("dflash", target, batch, 100, **OPTIONS)


def states_of(target, tokens):
    """The fused layers' states (len(tokens), 3 h) at every token."""
    with torch.no_grad():
        hidden = target.model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    return torch.cat([hidden[i][0] for i in LAYERS], -1)


def block_features(model, target, tokens, states, anchor):
    """The training forward's (K, h) output of one block at ``anchor`` of the sequence ``tokens``."""
    ids = torch.tensor([tokens])
    one = TrainBatch(ids, torch.ones(ids.shape), torch.ones_like(ids), drafter_states=states[None])
    frozen = FrozenTarget.from_model(target)
    with torch.no_grad():
        return _dflash_block_forward(model, model, one, frozen, torch.tensor([[anchor]]), torch.tensor([[True]]))[0]


def test_config_defaults_to_a_chain_of_the_block_and_refuses_what_cannot_work(target):
    model = build(target)
    config = model.config
    assert (config.depth, config.top_k, config.total_tokens) == (BLOCK - 1, 1, BLOCK - 1)
    assert len(model.layers) == 2 and model.fc.in_features == 3 * 64 and model.mask_embedding.shape == (64,)
    with pytest.raises(DFlashConfigError, match="drafter.depth=4 drafts past the 3 masked positions"):
        build(target, depth=4)
    with pytest.raises(DFlashConfigError, match="drafter.block_size takes a whole number from 2"):
        build(target, block_size=1)
    with pytest.raises(DFlashConfigError, match="drafter.aux_layer_ids must name target states 0..5"):
        build(target, aux_layer_ids=[0, 9])
    with pytest.raises(TreeOptionError, match="depth=5 drafts past the 3 masked positions"):
        serve(model, target, depth=5)
    with pytest.raises(EngineLayoutError, match="train one with drafter.qk_norm=true"):
        model.engine_layout("vllm", None, None)
    with pytest.raises(DFlashConfigError, match="drafter.qk_norm takes true or false"):
        build(target, qk_norm="yes")


def test_the_block_mask_sees_the_context_before_its_anchor_and_its_own_block():
    allowed = dflash_mask(torch.tensor([[2, 0]]), torch.tensor([[True, False]]), width=4, size=2)[0, 0]
    expected = torch.tensor(
        [  # context 0..3 | block 0 (anchor 2) | block 1 (unused)
            [1, 1, 0, 0, 1, 1, 0, 0],
            [1, 1, 0, 0, 1, 1, 0, 0],
            [0, 0, 0, 0, 0, 0, 1, 1],
            [0, 0, 0, 0, 0, 0, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(allowed, expected)


def test_a_block_reads_the_context_before_its_anchor_and_nothing_after(target, trained):
    """Changing the target's states at or after the anchor leaves the block unchanged (no future leaks
    through the injected context); changing them before it changes the block (the context is read)."""
    model, _ = trained
    tokens = random_prompts(1, seed=3, vocab=VOCAB)[0] + hf_greedy(target, random_prompts(1, 3, VOCAB)[0], 8)
    states, anchor = states_of(target, tokens), len(tokens) - 5
    reference = block_features(model, target, tokens, states, anchor)
    future = states.clone()
    future[anchor:] = torch.randn_like(future[anchor:])
    torch.testing.assert_close(block_features(model, target, tokens, future, anchor), reference)
    past = states.clone()
    past[anchor - 1] += 1.0
    assert (block_features(model, target, tokens, past, anchor) - reference).abs().max() > 1e-3


def test_blocks_of_one_sequence_do_not_see_each_other(target, trained):
    model, _ = trained
    tokens = random_prompts(1, seed=4, vocab=VOCAB)[0] + hf_greedy(target, random_prompts(1, 4, VOCAB)[0], 12)
    ids, states = torch.tensor([tokens]), states_of(target, tokens)[None]
    one = TrainBatch(ids, torch.ones(ids.shape), torch.ones_like(ids), drafter_states=states)
    frozen = FrozenTarget.from_model(target)
    kept = torch.tensor([[True, True]])
    with torch.no_grad():
        both = _dflash_block_forward(model, model, one, frozen, torch.tensor([[4, 9]]), kept)
        other = _dflash_block_forward(model, model, one, frozen, torch.tensor([[4, 6]]), kept)
    torch.testing.assert_close(both[0, :BLOCK], other[0, :BLOCK])  # block 0 whatever block 1 is
    torch.testing.assert_close(both[0, BLOCK:], block_features(model, target, tokens, states[0], 9))


def test_runtime_blocks_equal_the_training_blocks_round_after_round(target, trained):
    """The block drafted at decode time, with the drafter's context cache reused, trimmed and reset,
    equals the training forward's block at the root's position."""
    model, _ = trained
    drafter = serve(model, target)
    prompt = random_prompts(1, seed=7, vocab=VOCAB)[0]
    continuation = hf_greedy(target, prompt, 8)
    for committed in (0, 3, 3, 6, 2):  # grows, stays, grows, shrinks (a new generation's prefix)
        tokens = prompt + continuation[:committed]
        states = states_of(target, tokens)
        with torch.no_grad():
            drafted = drafter.block_logits(tokens, states[:-1])
        trained_block = block_features(model, target, tokens, states, len(tokens) - 1)
        torch.testing.assert_close(drafted, drafter.head(trained_block[1:]).float(), rtol=1e-4, atol=1e-5)


def test_qk_norm_normalises_each_head_in_training_and_at_decode_time_alike(target):
    """``qk_norm`` (Qwen3's layer, vLLM's dflash) adds q_norm / k_norm to each layer and only then: the
    default drafter's weights are the Llama layer's as before. With it the runtime's block still equals
    the training forward's, and the norms change the drafts."""
    plain, normed = build(target), build(target, qk_norm=True)
    assert not any("_norm.weight" in name and "self_attn" in name for name in plain.state_dict())
    extra = set(normed.state_dict()) - set(plain.state_dict())
    assert extra == {f"layers.{i}.self_attn.{n}_norm.weight" for i in range(2) for n in "qk"}
    with torch.no_grad():
        for parameter in normed.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    plain.load_state_dict({k: v for k, v in normed.state_dict().items() if k not in extra})
    tokens = random_prompts(1, seed=3, vocab=VOCAB)[0]
    states = states_of(target, tokens)
    with torch.no_grad():
        drafted = serve(normed.eval(), target).block_logits(tokens, states[:-1])
        without = serve(plain.eval(), target).block_logits(tokens, states[:-1])
    trained_block = block_features(normed, target, tokens, states, len(tokens) - 1)
    frozen_head = serve(normed, target).head
    torch.testing.assert_close(drafted, frozen_head(trained_block[1:]).float(), rtol=1e-4, atol=1e-5)
    assert (drafted - without).abs().max() > 1e-2


def test_a_round_is_one_drafter_forward(target, trained):
    assert_one_drafter_forward_per_round(trained[0], target, [(1, 3), (3, 6)], VOCAB)  # a chain and a tree


def test_loss_trains_the_drafter_only_and_evaluates_on_fixed_anchors(target, batch):
    model = build(target)
    frozen = FrozenTarget.from_model(target)
    model.init_from_target(frozen)
    out = family_loss(DFLASH)(model, batch, frozen)
    assert torch.isfinite(out.loss)
    assert {"loss/ce", "acc/step1", "acc/step3", "sim/accept_length", "sim/block_accept_length"} <= set(out.metrics)
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    assert model.mask_embedding.grad.abs().sum() > 0 and model.fc.weight.grad.abs().sum() > 0
    assert frozen.lm_head.weight.grad is None and frozen.embed_tokens.weight.grad is None
    hard = family_loss(DFLASH)(model, batch, frozen, soft_labels=False, gamma=0.0)
    assert torch.isfinite(hard.loss)
    model.eval()
    state = torch.get_rng_state()
    first = family_loss(DFLASH)(model, batch, frozen, anchors=4).metrics
    assert family_loss(DFLASH)(model, batch, frozen, anchors=4).metrics == first
    assert torch.equal(torch.get_rng_state(), state)  # evaluation leaves the training stream alone


def test_anchors_are_distinct_assistant_tokens_with_a_label_after_them():
    supervised = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 0], [0, 1, 1, 0, 0, 0, 0, 0]], dtype=torch.bool)
    starts, kept = sample_anchors(supervised, 8, torch.Generator().manual_seed(0))
    assert kept.sum(1).tolist() == [3, 1]
    assert sorted(starts[0][kept[0]].tolist()) == [2, 3, 4] and starts[1][kept[1]].tolist() == [1]


def test_a_short_self_distillation_gets_drafts_accepted_losslessly(target, batch, trained):
    model, losses = trained
    assert not torch.equal(model.mask_embedding, build(target).mask_embedding)  # the mask was learned
    assert losses[-1] < losses[0]
    frozen = FrozenTarget.from_model(target)
    assert family_loss(DFLASH)(model.eval(), batch, frozen).metrics["sim/accept_length"] > 2.0
    for tree in ({}, {"top_k": 3, "total_tokens": 6}):
        drafter = serve(model, target, **tree)
        prompts = random_prompts(6, seed=11, vocab=VOCAB)
        results = [generate(target, prompt, drafter, max_new_tokens=40, eos_token_ids=[EOS]) for prompt in prompts]
        for prompt, result in zip(prompts, results):
            assert result.tokens == hf_greedy(target, prompt, 40)
        tau = sum(len(r.tokens) for r in results) / sum(r.target_forwards for r in results)
        assert tau > 1.3, tree  # its drafts really get accepted


def test_dropping_the_context_loses_the_drafts(target, trained):
    """With the target's states zeroed the trained drafter's blocks change: it drafts from the context."""
    model, _ = trained
    tokens = random_prompts(1, seed=5, vocab=VOCAB)[0]
    states = states_of(target, tokens)
    with torch.no_grad():
        read = serve(model, target).block_logits(tokens, states[:-1])
        dropped = serve(model, target).block_logits(tokens, torch.zeros_like(states[:-1]))
    assert (read - dropped).abs().max() > 1e-2


def test_a_reduced_draft_vocabulary_decodes_losslessly(target):
    model = build(target, draft_vocab_size=40)
    model.fit_data(torch.arange(VOCAB))  # the 40 highest ids
    drafter = serve(model.eval(), target, top_k=2, total_tokens=5)
    for prompt in random_prompts(6, seed=5, vocab=VOCAB):
        assert generate(target, prompt, drafter, max_new_tokens=30, eos_token_ids=[EOS]).tokens == hf_greedy(
            target, prompt, 30
        )


def test_tune_fits_a_dflash_tree_that_generate_uses(tiny_target_dir, tmp_path):
    """``draftsmith tune`` counts each tree's acceptance from its own one-forward drafts, as real decoding
    accepts them, and ``generate`` then drafts the tree it chose, losslessly."""
    from draftsmith.cli import main
    from draftsmith.core.target import load_target
    from draftsmith.drafters.io import export_drafter
    from draftsmith.inference.measure.tune import Shape, record_counted_prompt, simulate_rounds, tune_base
    from draftsmith.inference.methods.table import build_drafter
    from draftsmith.inference.methods.tuned_trees import DeviceKey, read_tuned_trees

    tiny, layers = load_target(str(tiny_target_dir)), [0, 1]
    vocab = int(tiny.model.config.vocab_size)
    batch = fused_batch(tiny.model, vocab, layers, n=16, new_tokens=40)
    model, _ = train_from_target("dflash", tiny.model, batch, 60, aux_layer_ids=layers, block_size=BLOCK)
    export = export_drafter(model, tiny.identity.to_dict(), tmp_path / "dflash")
    base = tune_base(export, tiny)
    prompt = random_prompts(1, seed=0, vocab=vocab)[0]
    shapes = [Shape(1, 1, 1), Shape(3, 1, 3), Shape(2, 2, 4)]
    backends, eos = row_invariant_backends(), tiny.eos_token_ids
    record = record_counted_prompt(tiny, base, prompt, 16, shapes, backends)
    for shape in shapes:
        drafter = base.model.runtime_drafter(tiny.model, shape.options())
        real = generate(tiny.model, prompt, drafter, max_new_tokens=16, eos_token_ids=eos, backends=backends)
        assert simulate_rounds(record, shape, 16, set(eos)) == real.accept_lengths, shape
    argv = ["tune", str(export), "--target", str(tiny_target_dir), "--limit", "1", "--max-new-tokens", "8"]
    main([*argv, "--top-k", "1,2", "--total-tokens", "1,2,4"])
    entry = read_tuned_trees(export)[DeviceKey.current(tiny.model).text()]
    assert entry["calibration"]["search"]["max_depth"] == BLOCK - 1  # the block's masked positions
    drafter = build_drafter(f"dflash={export}", tiny)
    assert (drafter.depth, drafter.top_k, drafter.total_tokens) == tuple(
        entry["tree"][key] for key in ("depth", "top_k", "total_tokens")
    )
    assert generate(tiny.model, prompt, drafter, max_new_tokens=16, eos_token_ids=[EOS]).tokens == hf_greedy(
        tiny.model, prompt, 16
    )
