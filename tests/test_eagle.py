"""EAGLE / FSPAD drafters: model, loss, EAGLE-2 dynamic trees, export/load and lossless decoding."""

import pytest
import torch

from conftest import tiny_llama
from draftsmith.core.drafting import DraftContext
from draftsmith.core.tree import best_first_tree
from draftsmith.drafters.base import FrozenTarget, UnknownOptionError
from draftsmith.drafters.eagle import EagleConfig, EagleModel, causal_mask
from draftsmith.drafters.io import DrafterCheckpointError, export_drafter
from draftsmith.drafters.registry import get_family
from draftsmith.inference.runtime import generate
from draftsmith.train.losses import check_loss_options, family_loss
from draftsmith.train.recipe_loader import RecipeError
from helpers import assert_same_drafter_state, catch_up_split_and_whole, fit, hf_greedy, self_distilled_batch, serve
from helpers import random_prompts as _random_prompts

VOCAB = 97
EOS = 2


def random_prompts(n, seed):
    return _random_prompts(n, seed, VOCAB)


@pytest.fixture(scope="module")
def target():
    return tiny_llama(VOCAB, seed=0)


def train(family_name, target, batch, steps, **options):
    torch.manual_seed(0)
    family = get_family(family_name)
    model = family.build(target.config, options)
    frozen = FrozenTarget.from_model(target)
    losses = fit(model, lambda m: family_loss(family)(m, batch, frozen, feature_noise=0.0), steps)
    return model.eval(), losses


@pytest.fixture(scope="module")
def trained_fspad(target):
    model, _ = train("fspad", target, self_distilled_batch(target, VOCAB), 200, depth=4, top_k=3)
    return model


def test_best_first_tree_keeps_the_best_and_parents_first():
    # candidates: 0:a(-0.1) 1:b(-1.0) 2:a->c(-0.3) 3:a->d(-2.0) 4:a->c->e(-0.35)
    parents, tokens, scores = [-1, -1, 0, 0, 2], [10, 11, 12, 13, 14], [-0.1, -1.0, -0.3, -2.0, -0.35]
    tree, order = best_first_tree(parents, tokens, scores, budget=3)
    assert order == [0, 2, 4]
    assert tree.tokens.tolist() == [10, 12, 14] and tree.parents.tolist() == [-1, 0, 1]
    tree, order = best_first_tree(parents, tokens, scores, budget=4)
    assert sorted(order) == [0, 1, 2, 4] and tree.parents.tolist() == [-1, -1, 0, 2]
    # a child scoring above its parent (impossible with log-probs) still waits for the parent
    tree, _ = best_first_tree([-1, 0], [1, 2], [-5.0, -0.1], budget=1)
    assert tree.tokens.tolist() == [1]


@pytest.mark.parametrize("family", ["eagle", "fspad"])
def test_loss_is_finite_and_trains_only_the_drafter(target, family):
    batch = self_distilled_batch(target, VOCAB, n=3, new_tokens=8)
    model = get_family(family).build(target.config, {})
    frozen = FrozenTarget.from_model(target)
    out = family_loss(get_family(family))(model, batch, frozen)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    assert frozen.lm_head.weight.grad is None and frozen.embed_tokens.weight.grad is None
    assert {"loss/smooth_l1", "loss/ce", "acc/step1"} <= set(out.metrics) and "acc/step2" not in out.metrics
    assert (model.feature_sampler is not None) == (family == "fspad") == model.config.partial_alignment
    evaluated = family_loss(get_family(family))(model.eval(), batch, frozen, feature_noise=0.0)
    assert {"acc/step1", "acc/step3", "sim/accept_length"} <= set(evaluated.metrics)
    with torch.no_grad():  # training reads the supervised rows only; without noise it is the same loss
        trained = family_loss(get_family(family))(model.train(), batch, frozen, feature_noise=0.0)
    assert float(trained.loss) == pytest.approx(float(evaluated.loss), rel=1e-5)


def test_fspad_components_switch_off_separately(target):
    model = get_family("fspad").build(target.config, {"feature_sampler": False})
    assert model.feature_sampler is None and model.config.partial_alignment
    assert model.mlp.down_proj.out_features == 2 * target.config.hidden_size
    with pytest.raises(UnknownOptionError, match="did you mean 'feature_sampler'"):
        get_family("fspad").build(target.config, {"feature_sampeler": False})
    with pytest.raises(UnknownOptionError, match="'drafter.tree_top_k' is now 'drafter.top_k'"):
        get_family("fspad").build(target.config, {"tree_top_k": 3})
    from draftsmith.drafters.eagle import EagleConfigError

    with pytest.raises(EagleConfigError, match="draft_vocab_size must be between 0 .* 97, got 500"):
        get_family("fspad").build(target.config, {"draft_vocab_size": 500})
    with pytest.raises(EagleConfigError, match="drafter.top_k is 0, but top_k takes a whole number from 1 to 256"):
        get_family("eagle").build(target.config, {"top_k": 0})
    with pytest.raises(RecipeError, match="loss.ce_wieght"):
        check_loss_options(get_family("eagle"), {"ce_wieght": 0.1})


@pytest.mark.parametrize("family", ["eagle", "fspad"])
def test_overfits_one_batch(target, family):
    _, losses = train(family, target, self_distilled_batch(target, VOCAB, n=4, new_tokens=12), 60)
    assert losses[-1] < 0.5 * losses[0]


def test_padding_does_not_change_real_positions(target):
    batch = self_distilled_batch(target, VOCAB, n=2, new_tokens=6)
    model = get_family("eagle").build(target.config, {}).eval()
    embeds, features = torch.randn(1, 7, 64), torch.randn(1, 7, 64)
    positions = torch.arange(7)[None]
    alone = model(embeds[:, :5], features[:, :5], positions[:, :5]).next_features
    padded_mask = causal_mask(7, torch.float32, "cpu", torch.tensor([[1, 1, 1, 1, 1, 0, 0]]))
    padded = model(embeds, features, positions, attention_mask=padded_mask).next_features
    torch.testing.assert_close(padded[:, :5], alone)
    assert batch.input_ids.shape[0] == 2


@pytest.mark.parametrize("family", ["eagle", "fspad"])
def test_outputs_at_the_read_rows_only_equal_the_whole_forward(target, family):
    model = get_family(family).build(target.config, {}).eval()
    embeds, features, positions = torch.randn(2, 7, 64), torch.randn(2, 7, 64), torch.arange(7)[None].expand(2, -1)
    rows = torch.zeros(2, 7, dtype=torch.bool)
    rows[0, 2:5], rows[1, 6] = True, True
    whole = model(embeds, features, positions)
    partial = model(embeds, features, positions, rows=rows)
    for name in ("token_features", "next_features"):
        torch.testing.assert_close(getattr(partial, name)[rows], getattr(whole, name)[rows])
        assert not torch.allclose(getattr(partial, name)[~rows], getattr(whole, name)[~rows])


def test_an_exported_fspad_computes_what_the_trained_one_does(target, tmp_path, trained_fspad):
    export_drafter(
        trained_fspad, {"name": "t", "revision": "r", "config_hash": "c", "tokenizer_hash": "k"}, tmp_path / "d"
    )
    loaded = EagleModel.from_pretrained(tmp_path / "d").eval()
    assert loaded.config.drafter_family == "fspad" and loaded.config.target_identity["name"] == "t"
    args = (torch.randn(1, 6, 64), torch.randn(1, 6, 64), torch.arange(6)[None])
    torch.testing.assert_close(loaded(*args).next_features, trained_fspad(*args).next_features)


def _context(target, prompt, extra):
    tokens = prompt + extra
    with torch.no_grad():
        features = target.model(torch.tensor([tokens])).last_hidden_state[0, :-1]
    return DraftContext(tokens, len(prompt), features=features)


def test_incremental_drafter_cache_equals_one_pass(target, trained_fspad):
    prompt = random_prompts(1, seed=5)[0]
    full = prompt + hf_greedy(target, prompt, 12)
    stepwise = serve(trained_fspad, target)
    for cut in (len(prompt) + 1, len(prompt) + 4, len(full)):
        stepwise.propose(_context(target, full[:cut], []))
    fresh = serve(trained_fspad, target)
    fresh.propose(_context(target, full, []))
    assert stepwise._cache.layers[0].keys.shape[-2] == len(full) - 1
    torch.testing.assert_close(stepwise._cache.layers[0].keys, fresh._cache.layers[0].keys)
    torch.testing.assert_close(stepwise._root_top[0], fresh._root_top[0])


def test_a_long_catch_up_of_fspad_runs_its_layer_after_attention_at_the_last_position_only(
    target, trained_fspad, monkeypatch
):
    prompt = random_prompts(1, seed=11)[0]
    context = _context(target, prompt, hf_greedy(target, prompt, 24))
    split, whole, split_rows, whole_rows = catch_up_split_and_whole(
        trained_fspad, target, context, monkeypatch, trained_fspad.mlp
    )
    positions = len(context.tokens) - 1
    assert positions >= 16 and split_rows == [1] and whole_rows == [positions]
    assert_same_drafter_state(split, whole, positions)


def test_chain_expansion_equals_running_the_drafter_on_its_own_path(target, trained_fspad):
    """With top_k = 1 the tree is a chain; each node must be what a plain causal forward of the
    drafter over the committed inputs plus its own predicted (feature, token) pairs gives."""
    prompt = random_prompts(1, seed=7)[0]
    context = _context(target, prompt, hf_greedy(target, prompt, 3))
    drafter = serve(trained_fspad, target, depth=5, top_k=1, total_tokens=5)
    tree = drafter.propose(context)
    frozen = FrozenTarget.from_model(target)
    tokens, feats = list(context.tokens), list(context.features)
    chain = []
    with torch.no_grad():
        for _ in range(5):
            ids = torch.tensor(tokens[1:])
            out = trained_fspad(frozen.embed_tokens(ids)[None], torch.stack(feats)[None], torch.arange(len(ids))[None])
            token = int(frozen.lm_head(out.token_features[0, -1]).argmax())
            chain.append(token)
            tokens.append(token)
            feats.append(out.next_features[0, -1])
    assert tree.tokens.tolist() == chain and tree.parents.tolist() == [-1, 0, 1, 2, 3]
    assert drafter._cache.layers[0].keys.shape[-2] == len(context.tokens) - 1  # tree KV dropped


def test_a_trained_fspads_trees_are_accepted_losslessly(target, trained_fspad):
    random_eagle = get_family("eagle").build(target.config, {}).eval()
    taus = {}
    for name, model in (("random", random_eagle), ("trained", trained_fspad)):
        drafter = serve(model, target, total_tokens=10)
        results = []
        for prompt in random_prompts(12, seed=11):
            reference = hf_greedy(target, prompt, 48)
            result = generate(target, prompt, drafter, max_new_tokens=48, eos_token_ids=[EOS])
            assert result.tokens == reference
            results.append(result)
        taus[name] = sum(len(r.tokens) for r in results) / sum(r.target_forwards for r in results)
    assert taus["trained"] > 1.3  # the trained drafter's trees really get accepted


def test_draft_vocabulary_limits_proposals_and_stays_lossless(target):
    batch = self_distilled_batch(target, VOCAB, n=8, new_tokens=24)
    model, _ = train("fspad", target, batch, 80, draft_vocab_size=24)
    model.fit_data(torch.bincount(batch.input_ids[batch.attention_mask.bool()], minlength=VOCAB))
    allowed = set(model.draft_vocab.tolist())
    assert len(allowed) == 24
    drafter = serve(model, target)
    for prompt in random_prompts(6, seed=21):
        tree = drafter.propose(_context(target, prompt, []))
        assert set(tree.tokens.tolist()) <= allowed
        assert generate(target, prompt, drafter, max_new_tokens=32, eos_token_ids=[EOS]).tokens == hf_greedy(
            target, prompt, 32
        )


def test_config_follows_target_shape(target):
    config = EagleConfig.for_target(target.config)
    assert config.layer["hidden_size"] == 64 and config.layer["num_key_value_heads"] == 2
    assert config.layer_config().num_hidden_layers == 1


def test_loading_checks_the_target(tiny_target_dir, other_target_dir, tmp_path):
    from draftsmith.core.target import TargetError, load_target
    from draftsmith.inference.methods.table import build_drafter

    tiny, other = load_target(str(tiny_target_dir)), load_target(str(other_target_dir))
    model = get_family("fspad").build(tiny.model.config, {})
    export_drafter(model, tiny.identity.to_dict(), tmp_path / "fspad")
    drafter = build_drafter(f"fspad={tmp_path / 'fspad'}", tiny)
    assert drafter.wants_features and drafter.name == "fspad"
    assert build_drafter(str(tmp_path / "fspad"), tiny).name == "fspad"  # a directory alone works too
    with pytest.raises(TargetError, match="not this target: model config differs"):
        build_drafter(f"fspad={tmp_path / 'fspad'}", other)
    with pytest.raises(DrafterCheckpointError, match="holds a 'fspad' drafter, not 'eagle'; use --method fspad="):
        build_drafter(f"eagle={tmp_path / 'fspad'}", tiny)
    with pytest.raises(DrafterCheckpointError, match="no config.json"):
        build_drafter(f"eagle={tmp_path}", tiny)


def test_vllm_eagle_layout_computes_what_the_drafter_computes(target):
    """vLLM's EAGLE-1 model (SafeAILab layout): ``fc`` without bias, one Llama layer whose input norm is
    an identity, no final norm. Rebuilt from the exported config and tensors with transformers' own
    LlamaDecoderLayer, it gives the drafter's output: the fc bias moved exactly into attention biases."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from draftsmith.drafters.engine_layouts import Verifier

    torch.manual_seed(0)
    model = get_family("eagle").build(target.config, {"draft_vocab_size": 16}).eval()
    for parameter in model.parameters():  # a trained drafter: no zero or unit weights left
        torch.nn.init.normal_(parameter, std=0.2)
    export = model.engine_layout("vllm", Verifier("tiny/verifier"), None)
    config, tensors = export.config, export.tensors
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 1
    assert config["attention_bias"] is True and config["vocab_size"] == VOCAB and export.speculative_tokens == 5
    h, i, kv = 64, 128, 2 * 16
    assert {k: tuple(v.shape) for k, v in tensors.items()} == {
        "fc.weight": (h, 2 * h),
        "layers.0.self_attn.q_proj.weight": (h, h),
        "layers.0.self_attn.k_proj.weight": (kv, h),
        "layers.0.self_attn.v_proj.weight": (kv, h),
        "layers.0.self_attn.o_proj.weight": (h, h),
        "layers.0.self_attn.q_proj.bias": (h,),
        "layers.0.self_attn.k_proj.bias": (kv,),
        "layers.0.self_attn.v_proj.bias": (kv,),
        "layers.0.self_attn.o_proj.bias": (h,),
        "layers.0.post_attention_layernorm.weight": (h,),
        "layers.0.mlp.gate_proj.weight": (i, h),
        "layers.0.mlp.up_proj.weight": (i, h),
        "layers.0.mlp.down_proj.weight": (h, i),
    }
    layer_config = LlamaConfig(**{k: v for k, v in config.items() if k != "architectures"})
    layer = LlamaDecoderLayer(layer_config, layer_idx=0).eval()
    layer.input_layernorm = torch.nn.Identity()
    prefix = "layers.0."
    layer.load_state_dict({k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}, strict=False)
    embeds, features = torch.randn(1, 7, h), torch.randn(1, 7, h)
    positions = torch.arange(7)[None]
    with torch.no_grad():
        x = torch.cat([embeds, features], -1) @ tensors["fc.weight"].T
        rope = LlamaRotaryEmbedding(layer_config)(x, positions)
        served = layer(x, attention_mask=causal_mask(7, x.dtype, x.device), position_embeddings=rope)
        served = served[0] if isinstance(served, tuple) else served
        ours = model(embeds, features, positions).token_features
    torch.testing.assert_close(served, ours, rtol=1e-5, atol=1e-5)


def test_fspad_and_other_formats_have_no_engine_layout(target):
    from draftsmith.drafters.engine_layouts import EngineLayoutError, Verifier

    with pytest.raises(EngineLayoutError, match="FSPAD has no serving-engine layout"):
        get_family("fspad").build(target.config, {}).engine_layout("vllm", Verifier("x"), None)
    eagle = get_family("eagle").build(target.config, {})
    for fmt in ("speculators", "sglang"):
        with pytest.raises(EngineLayoutError, match=f"an eagle drafter has no {fmt} layout.*use --format vllm"):
            eagle.engine_layout(fmt, Verifier("x"), None)


def test_tree_options_at_serve_time(tiny_target_dir, tmp_path):
    from draftsmith.core.target import load_target
    from draftsmith.drafters.base import TreeOptionError
    from draftsmith.inference.methods.table import build_drafter, split_tree_options

    assert split_tree_options("a:b/dir:depth=4:top_k=2") == ("a:b/dir", {"depth": "4", "top_k": "2"})
    tiny = load_target(str(tiny_target_dir))
    export_drafter(get_family("eagle").build(tiny.model.config, {}), tiny.identity.to_dict(), tmp_path / "e")
    drafter = build_drafter(f"eagle={tmp_path / 'e'}:depth=3:top_k=2:total_tokens=5", tiny)
    assert (drafter.depth, drafter.top_k, drafter.total_tokens) == (3, 2, 5)
    with pytest.raises(TreeOptionError, match="eagle has no tree option width; it takes depth, top_k, total_tokens"):
        build_drafter(f"eagle={tmp_path / 'e'}:width=3", tiny)
