"""EAGLE-3 / FSPAD-3 drafters: draft vocabulary maps, the training-time test, export/load and lossless
EAGLE-2 trees over the fused target layers."""

import pytest
import torch

from conftest import tiny_llama
from draftsmith.core.drafting import DraftContext
from draftsmith.drafters.base import FrozenTarget
from draftsmith.drafters.eagle import EagleConfigError
from draftsmith.drafters.eagle3 import Eagle3Model, default_aux_layer_ids
from draftsmith.drafters.io import export_drafter
from draftsmith.drafters.registry import get_family
from draftsmith.drafters.vocab import draft_vocab_maps
from draftsmith.inference.runtime import generate
from draftsmith.train.batch import TrainBatch
from draftsmith.train.loader import online_features
from draftsmith.train.losses import check_loss_options, family_loss, loss_option_names
from draftsmith.train.losses.eagle3 import answer_starts, eagle3_loss, walked_tau
from draftsmith.train.losses.ttt import read_rows, ttt_mask, ttt_unroll
from draftsmith.train.recipe_loader import RecipeError
from helpers import assert_same_drafter_state, catch_up_split_and_whole, hf_greedy, padded, serve, train_from_target
from helpers import fused_batch as _fused_batch
from helpers import random_prompts as _random_prompts

VOCAB = 97
EOS = 2
LAYERS = [0, 2, 3]  # the states entering layers 0, 2 and 3 of the 5-layer target


def random_prompts(n, seed):
    return _random_prompts(n, seed, VOCAB)


@pytest.fixture(scope="module")
def target():
    return tiny_llama(VOCAB, seed=0, num_hidden_layers=5)


def fused_batch(target, layers, **kwargs):
    return _fused_batch(target, VOCAB, layers, **kwargs)


def train(family_name, target, batch, steps, **options):
    return train_from_target(family_name, target, batch, steps, aux_layer_ids=LAYERS, **options)


@pytest.fixture(scope="module")
def trained_eagle3(target):
    model, _ = train("eagle3", target, fused_batch(target, LAYERS), 150, depth=4, top_k=3)
    return model


def test_config_defaults_follow_vllm_and_refuse_bad_layers(target):
    model = get_family("eagle3").build(target.config, {})
    assert model.config.aux_layer_ids == default_aux_layer_ids(5) == [2, 2, 2]
    assert default_aux_layer_ids(30) == [2, 15, 27]  # SmolLM2, as vLLM picks them
    assert model.config.feature_layers() == (2, 2, 2) and model.config.draft_vocab_size == VOCAB
    assert model.fc.in_features == 3 * 64 and model.lm_head.out_features == VOCAB
    with pytest.raises(EagleConfigError, match="aux_layer_ids must name at least two of the target's layers 0..4"):
        get_family("eagle3").build(target.config, {"aux_layer_ids": [1, 5]})
    with pytest.raises(EagleConfigError, match="ttt_steps must be >= 1"):
        get_family("eagle3").build(target.config, {"ttt_steps": 0})
    fspad3 = get_family("fspad3").build(target.config, {"partial_alignment": False})
    assert fspad3.feature_sampler is not None and fspad3.layer.mlp.down_proj.out_features == 64
    assert get_family("fspad3").build(target.config, {}).layer.mlp.down_proj.out_features == 128


def test_draft_vocabulary_maps_round_trip(target, tmp_path):
    ids = torch.tensor([3, 4, 10, 50, 96])
    d2t, t2d = draft_vocab_maps(ids, VOCAB)
    assert d2t.dtype == torch.long and t2d.dtype == torch.bool and t2d.shape == (VOCAB,)
    assert (torch.arange(5) + d2t).tolist() == ids.tolist() and t2d.nonzero().flatten().tolist() == ids.tolist()

    model = get_family("eagle3").build(target.config, {"aux_layer_ids": LAYERS, "draft_vocab_size": 6})
    counts = torch.zeros(VOCAB, dtype=torch.long)
    counts[[90, 7, 33, 12, 61, 5]] = torch.tensor([9, 8, 7, 6, 5, 4])
    counts[40] = 1  # the 7th most frequent: left out
    model.fit_data(counts)
    drafted = [5, 7, 12, 33, 61, 90]  # the six most frequent, ascending
    assert model.draft_token_ids().tolist() == drafted
    assert model.t2d.nonzero().flatten().tolist() == drafted
    assert model.token_ids(torch.tensor([0, 5])).tolist() == [5, 90]
    model.init_from_target(FrozenTarget.from_model(target))
    torch.testing.assert_close(model.lm_head.weight, target.lm_head.weight[drafted])
    export_drafter(model, {"name": "t"}, tmp_path / "d")
    loaded = Eagle3Model.from_pretrained(tmp_path / "d")
    assert loaded.draft_token_ids().tolist() == drafted and torch.equal(loaded.t2d, model.t2d)
    assert loaded.config.aux_layer_ids == LAYERS and loaded.config.drafter_family == "eagle3"


def test_a_warm_start_into_a_larger_draft_vocabulary_keeps_each_shared_tokens_trained_row(target, tmp_path):
    def drafter(size, counts):
        model = get_family("eagle3").build(target.config, {"aux_layer_ids": LAYERS, "draft_vocab_size": size})
        model.fit_data(counts)
        model.init_from_target(FrozenTarget.from_model(target))
        return model

    counts = torch.arange(VOCAB, 0, -1)  # token i is the i-th most frequent
    small = drafter(6, counts)
    with torch.no_grad():
        small.lm_head.weight.add_(1.0)  # "trained": away from the target's rows
        small.fc.weight.mul_(2.0)
    export_drafter(small, {"name": "t"}, tmp_path / "small")
    counts[[3, 4]] = 0  # two of the small vocabulary's tokens are no longer among the larger one's
    large = drafter(10, counts)
    target_rows = large.lm_head.weight.detach().clone()
    fresh = large.load_initial_weights(tmp_path / "small")
    mine = large.draft_token_ids().tolist()
    assert mine == [0, 1, 2, 5, 6, 7, 8, 9, 10, 11]  # this run's vocabulary stays
    for row, token in enumerate(mine):
        expected = small.lm_head.weight[token] if token < 6 else target_rows[row]
        assert torch.equal(large.lm_head.weight[row], expected), token
    assert torch.equal(large.fc.weight, small.fc.weight)
    assert fresh == ["lm_head.weight's rows of the 6 of 10 draft tokens it had no row for"]
    same_size = drafter(6, torch.arange(VOCAB))  # another vocabulary of the same size: loaded whole
    assert same_size.load_initial_weights(tmp_path / "small") == []
    assert same_size.draft_token_ids().tolist() == list(range(6))
    assert torch.equal(same_size.lm_head.weight, small.lm_head.weight)


def test_ttt_mask_shape():
    mask = ttt_mask(torch.tensor([[1, 1, 1, 0]]), 2, torch.float32)
    allowed = (mask[0, 0] == 0).int()
    assert allowed.shape == (4, 12)
    assert allowed[:, :4].tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]  # padded row: itself
    assert allowed[:, 4:8].tolist() == allowed[:, 8:].tolist() == torch.eye(4, dtype=torch.int).tolist()


@pytest.mark.parametrize("family", ["eagle3", "fspad3"])
def test_training_time_test_never_sees_a_later_position(target, family):
    """Changing the target states after position t, and the tokens after the last one any step at t
    reads, leaves every step's output at t unchanged."""
    torch.manual_seed(0)
    model = get_family(family).build(target.config, {"aux_layer_ids": LAYERS, "ttt_steps": 3})
    frozen = FrozenTarget.from_model(target)
    ids = torch.randint(4, VOCAB, (2, 12))
    attention = torch.ones_like(ids)
    states = torch.randn(2, 12, 3 * 64)
    t = 5
    changed_ids, changed_states = ids.clone(), states.clone()
    changed_ids[:, t + 4 :] = torch.randint(4, VOCAB, (2, 12 - t - 4))  # step 2 at t reads x_{t+3}
    changed_states[:, t + 1 :] += torch.randn(2, 12 - t - 1, 3 * 64)
    with torch.no_grad():
        before = list(ttt_unroll(model, frozen, ids, attention, states))
        after = list(
            ttt_unroll(model, frozen, changed_ids, changed_states.new_ones(1).long() * attention, changed_states)
        )
    for first, second in zip(before, after):
        torch.testing.assert_close(first.token_features[:, : t + 1], second.token_features[:, : t + 1])
        assert not torch.allclose(first.token_features[:, t + 1 :], second.token_features[:, t + 1 :])


@pytest.mark.parametrize("family", ["eagle3", "fspad3"])
def test_training_time_test_at_the_read_rows_only_equals_the_whole_unroll(target, family):
    """The MLP skipped where no step reads a position changes nothing where one does."""
    torch.manual_seed(0)
    model = get_family(family).build(target.config, {"aux_layer_ids": LAYERS, "ttt_steps": 3})
    frozen = FrozenTarget.from_model(target)
    ids, states = torch.randint(4, VOCAB, (2, 12)), torch.randn(2, 12, 3 * 64)
    attention = torch.ones_like(ids)
    attention[1, 9:] = 0
    labels = [torch.zeros(2, 12, dtype=torch.bool) for _ in range(3)]
    labels[0][0, 6:9], labels[1][0, 3], labels[2][1, 2:5] = True, True, True
    read = read_rows(labels)
    assert read[2].equal(labels[2]) and read[0].equal(labels[0] | labels[1] | labels[2])
    with torch.no_grad():
        whole = list(ttt_unroll(model, frozen, ids, attention, states))
        partial = list(ttt_unroll(model, frozen, ids, attention, states, read=read))
    for step, (a, b) in enumerate(zip(whole, partial)):
        torch.testing.assert_close(a.token_features[labels[step]], b.token_features[labels[step]])
        assert not torch.allclose(a.token_features[~read[step]], b.token_features[~read[step]])


@pytest.mark.parametrize("family", ["eagle3", "fspad3"])
def test_loss_is_finite_trains_only_the_drafter_and_overfits(target, family):
    batch = fused_batch(target, LAYERS, n=4, new_tokens=12)
    model = get_family(family).build(target.config, {"aux_layer_ids": LAYERS})
    frozen = FrozenTarget.from_model(target)
    out = family_loss(get_family(family))(model, batch, frozen)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    assert frozen.lm_head.weight.grad is None and frozen.embed_tokens.weight.grad is None
    assert {"loss/step0", "loss/step2", "acc/step1", "acc/step3", "sim/accept_length"} <= set(out.metrics)
    assert out.metrics["sim/accept_length"] < 1.5 and out.metrics["sim/answer_start_accept_length"] < 1.5
    # the soft CE's floor is the random target's entropy (near log V): the KL part is what drops
    trained, losses = train(family, target, batch, 60)
    assert losses[-1] < losses[0] - 0.03
    assert family_loss(get_family(family))(trained, batch, frozen).metrics["sim/accept_length"] > 2.5


def test_answer_starts_are_the_first_tokens_of_every_answer():
    supervised = torch.tensor([[0, 1, 1, 1, 1, 0, 0, 1, 1, 1], [1, 1, 0, 1, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    expected = [[0, 1, 1, 0, 0, 0, 0, 1, 1, 0], [1, 1, 0, 1, 0, 0, 0, 0, 0, 0]]
    assert answer_starts(supervised, 2).int().tolist() == expected


def test_walked_tau_counts_rounds_as_the_runtime_does():
    window = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 0]], dtype=torch.bool)  # an 8-token answer after a prompt
    # the prompt's forward, then rounds of 4 and of 3 (of 4) tokens
    assert walked_tau([torch.ones_like(window)] * 3, window) == 8 / 3
    assert walked_tau([torch.zeros_like(window)] * 3, window) == 1.0
    hit, miss = torch.ones_like(window), torch.zeros_like(window)
    assert walked_tau([miss, hit, hit], window) == 1.0  # only leading hits are accepted
    assert walked_tau([hit, miss, hit], window) == 8 / 5  # two tokens a round


def test_the_walked_tau_is_the_runtimes_tau_for_a_chain(target, trained_eagle3):
    """``sim/answer_start_tau`` of the training-time test on the runtime's own greedy answers equals the τ
    the runtime measured decoding them with a top-1 chain of the drafter's ``ttt_steps`` tokens."""
    drafter = serve(trained_eagle3, target, depth=3, top_k=1, total_tokens=3)
    prompts, tokens, forwards = random_prompts(6, seed=21), [], 0
    for prompt in prompts:
        result = generate(target, prompt, drafter, max_new_tokens=30, eos_token_ids=[EOS])
        tokens.append(result.tokens)
        forwards += result.target_forwards
    ids, attention = padded([prompt + answer for prompt, answer in zip(prompts, tokens)])
    loss_mask = torch.zeros_like(attention, dtype=torch.float)
    for row, (prompt, answer) in enumerate(zip(prompts, tokens)):
        loss_mask[row, len(prompt) : len(prompt) + len(answer)] = 1
    batch = TrainBatch(ids, loss_mask, attention)
    batch.hidden_states, batch.drafter_states = online_features(target, batch, tuple(LAYERS))
    with torch.no_grad():
        metrics = eagle3_loss(trained_eagle3, batch, FrozenTarget.from_model(target)).metrics
    runtime_tau = sum(map(len, tokens)) / forwards
    assert 1.3 < runtime_tau and metrics["sim/answer_start_tau"] == pytest.approx(runtime_tau)
    assert metrics["sim/answer_start_tau"] < metrics["sim/answer_start_accept_length"]


def _context(target, prompt, extra, layers):
    tokens = prompt + extra
    with torch.no_grad():
        hidden = target.model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    return DraftContext(tokens, len(prompt), features=torch.cat([hidden[i][0, :-1] for i in layers], -1))


def test_runtime_chain_is_the_training_time_test(target, trained_eagle3):
    """A top-1 chain drafted at decode time equals the training-time test's steps at the last committed
    position when the unrolled tokens are the chain itself: same masks, same positions."""
    prompt = random_prompts(1, seed=7)[0]
    context = _context(target, prompt, hf_greedy(target, prompt, 3), LAYERS)
    drafter = serve(trained_eagle3, target, depth=3, top_k=1, total_tokens=3)
    assert drafter.feature_layers == tuple(LAYERS)
    chain = drafter.propose(context).tokens.tolist()
    ids = torch.tensor([context.tokens + chain])
    states = torch.cat([context.features, context.features[-1:].repeat(len(chain) + 1, 1)])[None]
    last = len(context.tokens) - 2  # the position reading the root token
    with torch.no_grad():
        steps = ttt_unroll(trained_eagle3, FrozenTarget.from_model(target), ids, torch.ones_like(ids), states)
        unrolled = [
            int(trained_eagle3.token_ids(trained_eagle3.logits(out.token_features[0, last]).argmax())) for out in steps
        ]
    assert unrolled == chain


def test_a_long_catch_up_runs_the_layer_after_attention_at_its_last_position_only(target, trained_eagle3, monkeypatch):
    """A prompt's catch-up reads the outputs of its last position only: the others write their keys and
    values and nothing more, leaving the cache and the root as the whole layer at every position does."""
    prompt = random_prompts(1, seed=11)[0]
    context = _context(target, prompt, hf_greedy(target, prompt, 24), LAYERS)
    split, whole, split_rows, whole_rows = catch_up_split_and_whole(
        trained_eagle3, target, context, monkeypatch, trained_eagle3.layer.mlp
    )
    positions = len(context.tokens) - 1
    assert positions >= 16 and split_rows == [1] and whole_rows == [positions]
    assert_same_drafter_state(split, whole, positions)


@pytest.mark.parametrize("family", ["eagle3", "fspad3"])
def test_a_reduced_draft_vocabulary_and_a_trained_eagle3_decode_losslessly(target, trained_eagle3, family):
    models = {
        "random": get_family(family).build(target.config, {"aux_layer_ids": LAYERS, "draft_vocab_size": 40}).eval()
    }
    if family == "eagle3":
        models["trained"] = trained_eagle3
    for name, model in models.items():
        drafter = serve(model, target, total_tokens=10)
        results = []
        for prompt in random_prompts(10, seed=11):
            result = generate(target, prompt, drafter, max_new_tokens=40, eos_token_ids=[EOS])
            assert result.tokens == hf_greedy(target, prompt, 40)
            results.append(result)
        tau = sum(len(r.tokens) for r in results) / sum(r.target_forwards for r in results)
        if name == "trained":
            assert tau > 1.3  # its trees really get accepted


def test_an_exported_eagle3_reads_the_target_alike_without_its_embedding(target, tmp_path, trained_eagle3):
    export_drafter(
        trained_eagle3, {"name": "t", "revision": "r", "config_hash": "c", "tokenizer_hash": "k"}, tmp_path / "d"
    )
    loaded = Eagle3Model.from_pretrained(tmp_path / "d").eval()
    args = (torch.randn(1, 6, 64), torch.randn(1, 6, 3 * 64), torch.arange(6)[None])
    with torch.no_grad():
        torch.testing.assert_close(
            loaded.read_target(*args).token_features, trained_eagle3.read_target(*args).token_features
        )
    assert "embed_tokens.weight" not in loaded.state_dict()


def test_teacher_chunks_do_not_change_the_loss(target):
    batch = fused_batch(target, LAYERS, n=3, new_tokens=8)
    batch.loss_mask[:, :6] = 0  # prompt rows: no teacher needed there
    model = get_family("eagle3").build(target.config, {"aux_layer_ids": LAYERS, "draft_vocab_size": 50})
    model.fit_data(torch.bincount(batch.input_ids.flatten(), minlength=VOCAB))
    frozen = FrozenTarget.from_model(target)
    whole = family_loss(get_family("eagle3"))(model, batch, frozen, teacher_chunk_rows=0)
    chunked = family_loss(get_family("eagle3"))(model, batch, frozen, teacher_chunk_rows=5)
    torch.testing.assert_close(whole.loss, chunked.loss)
    # equal up to rounding: on some CPUs a matmul's rounding depends on its number of rows
    assert chunked.metrics == pytest.approx(whole.metrics, rel=1e-6)


@pytest.mark.parametrize("draft_vocab", [50, 0])  # 0: the whole vocabulary
@pytest.mark.parametrize("family", ["eagle3", "dflash"])
def test_the_cached_greedy_tokens_leave_the_loss_as_it_was(target, family, draft_vocab):
    """A batch carrying the target's greedy tokens (as a feature cache keeps them) computes only the draft
    vocabulary's columns of the teacher, and the loss and its metrics stay what the full product gives;
    wrong tokens would change them (the loss masks and scores by them)."""
    from draftsmith.data.features import target_argmax

    batch = fused_batch(target, LAYERS, n=3, new_tokens=10)
    batch.loss_mask[:, :6] = 0
    torch.manual_seed(0)
    options = {"aux_layer_ids": LAYERS} if family == "eagle3" else {}
    model = get_family(family).build(target.config, {"draft_vocab_size": draft_vocab, **options})
    model.fit_data(torch.bincount(batch.input_ids.flatten(), minlength=VOCAB))
    frozen, loss = FrozenTarget.from_model(target), family_loss(get_family(family))

    def run(argmax):
        batch.target_argmax = argmax
        torch.manual_seed(1)  # DFlash samples its anchors
        return loss(model, batch, frozen)

    computed = run(None)
    cached = run(target_argmax(frozen.lm_head, batch.hidden_states).long())
    torch.testing.assert_close(cached.loss, computed.loss)
    assert cached.metrics == pytest.approx(computed.metrics, rel=1e-6)
    if draft_vocab:  # with every token drafted the mask keeps all rows, and an untrained drafter hits almost none
        shifted = run((target_argmax(frozen.lm_head, batch.hidden_states).long() + 1) % VOCAB)
        assert shifted.metrics != pytest.approx(computed.metrics, rel=1e-3)


def _eagle3_loss_case(target, **build):
    """A batch with prompt rows and a drafter over a 50-token draft vocabulary (some target argmaxes not
    drafted): what the loss options below are checked on."""
    batch = fused_batch(target, LAYERS, n=3, new_tokens=10)
    batch.loss_mask[:, :6] = 0
    torch.manual_seed(0)
    model = get_family("eagle3").build(target.config, {"aux_layer_ids": LAYERS, "draft_vocab_size": 50, **build})
    model.fit_data(torch.bincount(batch.input_ids.flatten(), minlength=VOCAB))
    return model, batch, FrozenTarget.from_model(target)


def _chain_metrics(metrics):
    return {key: value for key, value in metrics.items() if key.startswith(("acc/", "sim/"))}


def test_the_new_loss_options_are_recipe_keys_and_off_by_default(target):
    names = loss_option_names(get_family("eagle3"))
    assert {"topk_distill", "topk_weight", "align_mask", "align_topk"} <= set(names)
    model, batch, frozen = _eagle3_loss_case(target)
    plain = eagle3_loss(model, batch, frozen)
    off = eagle3_loss(model, batch, frozen, topk_distill=0, topk_weight=5.0, align_mask=False, align_topk=1)
    torch.testing.assert_close(plain.loss, off.loss)
    assert plain.metrics == off.metrics
    checked = check_loss_options(get_family("eagle3"), {"topk_distill": 10, "topk_weight": "0.5", "align_mask": True})
    assert checked == {"topk_distill": 10, "topk_weight": 0.5, "align_mask": True}
    with pytest.raises(RecipeError, match="align_topk"):
        eagle3_loss(model, batch, frozen, align_mask=True, align_topk=0)


def test_top_k_distillation_over_the_whole_draft_vocabulary_adds_the_soft_ce_again(target):
    """K = the draft vocabulary: every step's top-K term is its CE, so the loss is (1 + weight) times
    the plain one; a smaller K adds less; the chain metrics never move."""
    model, batch, frozen = _eagle3_loss_case(target)
    plain = eagle3_loss(model, batch, frozen)
    whole = eagle3_loss(model, batch, frozen, topk_distill=50, topk_weight=0.5)
    torch.testing.assert_close(whole.loss, 1.5 * plain.loss)
    for step in range(3):
        assert whole.metrics[f"loss/topk{step}"] == pytest.approx(plain.metrics[f"loss/step{step}"], rel=1e-5)
    assert _chain_metrics(whole.metrics) == _chain_metrics(plain.metrics)
    few = eagle3_loss(model, batch, frozen, topk_distill=3, topk_weight=0.5)
    assert plain.loss < few.loss < whole.loss
    torch.testing.assert_close(eagle3_loss(model, batch, frozen, topk_distill=1000).loss, 2 * plain.loss)  # K capped


def _expected_step_losses(model, batch, frozen, align_top_k=None):
    """Independently of the loss: each step's mean soft CE over its supervised, drafted positions and,
    with ``align_top_k``, only where every earlier step's ``align_top_k`` best columns held the token the
    next step reads (a step without a label there breaks the chain); and those positions."""
    supervised = (batch.loss_mask * batch.attention_mask).bool()
    vocab = model.draft_token_ids()
    with torch.no_grad():
        steps = list(ttt_unroll(model, frozen, batch.input_ids, batch.attention_mask, batch.drafter_states))
        target_logits = frozen.lm_head(batch.hidden_states)
    width, on_chain, losses, kept = supervised.shape[1], torch.ones_like(supervised), [], []
    for step, out in enumerate(steps):
        ahead = 2 + step  # step i at t predicts x_{t+2+i} from the target state at t+1+i
        rows = torch.zeros_like(supervised)
        rows[:, : width - ahead] = supervised[:, ahead:] & model.t2d[target_logits[:, ahead - 1 : -1].argmax(-1)]
        if align_top_k:
            rows &= on_chain
        student = model.logits(out.token_features)[:, : width - ahead]
        teacher = target_logits[:, ahead - 1 : -1][..., vocab]
        ce = -(teacher.softmax(-1) * student.log_softmax(-1)).sum(-1)
        losses.append(float(ce[rows[:, : width - ahead]].mean().detach()))
        kept.append(rows)
        best = model.token_ids(student.topk(align_top_k or 1, -1).indices)
        proposed = torch.zeros_like(supervised)
        proposed[:, : width - ahead] = (best == batch.input_ids[:, ahead:, None]).any(-1) & supervised[:, ahead:]
        on_chain = on_chain & proposed
    return losses, kept


def test_align_mask_trains_a_step_only_where_the_drafter_proposed_every_earlier_input(target):
    model, batch, frozen = _eagle3_loss_case(target, ttt_steps=3)
    plain = eagle3_loss(model, batch, frozen)
    masked = eagle3_loss(model, batch, frozen, align_mask=True, align_topk=20)
    expected, kept = _expected_step_losses(model, batch, frozen, align_top_k=20)
    unmasked, every = _expected_step_losses(model, batch, frozen)
    for step in range(3):
        assert plain.metrics[f"loss/step{step}"] == pytest.approx(unmasked[step], rel=1e-5)
        assert masked.metrics[f"loss/step{step}"] == pytest.approx(expected[step], rel=1e-5)
    # not vacuous: steps 1 and 2 drop some of their positions and keep some; step 0 keeps all
    assert kept[0].equal(every[0])
    assert all(0 < int(kept[step].sum()) < int(every[step].sum()) for step in (1, 2))
    assert _chain_metrics(masked.metrics) == _chain_metrics(plain.metrics)
    assert masked.metrics["align/step0"] == 1.0 > masked.metrics["align/step1"] >= masked.metrics["align/step2"] > 0


def test_answer_start_weight_weighs_the_first_tokens_of_each_answer(target, monkeypatch):
    """Weight 1 is the plain loss bit for bit; otherwise each step's loss is a weighted mean of the
    answer-start rows' and the later rows' CE, so it lies strictly between the two groups' means (weight
    0: the later rows alone; a huge weight: the first rows alone)."""
    import draftsmith.train.losses.eagle3 as losses

    model, batch, frozen = _eagle3_loss_case(target)
    plain = eagle3_loss(model, batch, frozen)
    same = eagle3_loss(model, batch, frozen, answer_start_weight=1.0)
    torch.testing.assert_close(plain.loss, same.loss, rtol=0, atol=0)
    assert plain.metrics == same.metrics
    monkeypatch.setattr(losses, "ANSWER_START_TOKENS", 4)  # the test's answers are 10 tokens long
    later, weighted, first = (eagle3_loss(model, batch, frozen, answer_start_weight=w) for w in (0.0, 3.0, 1e6))
    for step in range(model.config.ttt_steps):
        low, high = sorted((later.metrics[f"loss/step{step}"], first.metrics[f"loss/step{step}"]))
        assert low < weighted.metrics[f"loss/step{step}"] < high
    unweighted = eagle3_loss(model, batch, frozen)
    assert _chain_metrics(weighted.metrics) == _chain_metrics(unweighted.metrics)  # accuracies do not move
    assert check_loss_options(get_family("eagle3"), {"answer_start_weight": "2"}) == {"answer_start_weight": 2.0}
