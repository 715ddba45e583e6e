"""Medusa-1 heads: model, loss and its shifts, static/dynamic trees, calibration, export/load, lossless decoding."""

import json
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from conftest import tiny_llama
from draftsmith.core.drafting import DraftContext
from draftsmith.drafters.base import FrozenTarget, UnknownOptionError
from draftsmith.drafters.io import export_drafter
from draftsmith.drafters.medusa import (
    DEFAULT_TREES,
    MedusaConfig,
    MedusaHeads,
    MedusaTreeError,
    StaticTree,
    calibrated_paths,
    expected_accept_length,
    resolve_tree,
)
from draftsmith.drafters.registry import get_family
from draftsmith.inference.runtime import generate
from draftsmith.train.batch import TrainBatch
from draftsmith.train.losses import check_loss_options
from draftsmith.train.losses.medusa import medusa_loss
from draftsmith.train.recipe_loader import RecipeError
from helpers import fit, hf_greedy, prepare_arithmetic_chats, self_distilled_batch, serve
from helpers import random_prompts as _random_prompts

VOCAB = 97
EOS = 2


def random_prompts(n, seed):
    return _random_prompts(n, seed, VOCAB)


REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(VOCAB, seed=0)


def build(target, **options):
    model = get_family("medusa").build(target.config, options)
    model.init_from_target(FrozenTarget.from_model(target))
    return model


def train(target, batch, steps, lr=3e-3, **options):
    torch.manual_seed(0)
    model = build(target, **options)
    frozen = FrozenTarget.from_model(target)
    losses = fit(model, lambda m: medusa_loss(m, batch, frozen), steps, lr)
    return model.eval(), losses


@pytest.fixture(scope="module")
def trained(target):
    model, _ = train(target, self_distilled_batch(target, VOCAB), 150, tree="medusa-16")
    return model


def test_shapes_and_distinct_modules(target):
    model = build(target, num_heads=3, num_layers=2)
    logits = model([torch.randn(5, 64), torch.randn(2, 64), torch.randn(0, 64)])
    assert [tuple(x.shape) for x in logits] == [(5, VOCAB), (2, VOCAB), (0, VOCAB)]
    assert model.all_heads(torch.randn(64)).shape == (3, VOCAB)
    assert model.all_heads(torch.randn(4, 7, 64)).shape == (4, 7, 3, VOCAB)
    blocks = [block for head in model.medusa_head for block in head[:-1]]
    assert len(blocks) == 6 and len({id(b) for b in blocks}) == 6
    assert len({id(head[-1].weight) for head in model.medusa_head}) == 3
    with torch.no_grad():
        blocks[0].linear.weight.add_(1.0)
    assert all(float(b.linear.weight.detach().abs().sum()) == 0 for b in blocks[1:])  # nothing shared


@pytest.mark.parametrize("draft_vocab_size", [0, 24])
def test_every_head_starts_as_the_targets_lm_head(target, draft_vocab_size):
    model = get_family("medusa").build(target.config, {"num_layers": 2, "draft_vocab_size": draft_vocab_size})
    model.fit_data(torch.arange(VOCAB).float())  # the most frequent = the highest ids
    model.init_from_target(FrozenTarget.from_model(target))
    features = torch.randn(6, 64)
    reference = target.lm_head(features)
    if draft_vocab_size:
        assert model.draft_vocab.tolist() == list(range(VOCAB - draft_vocab_size, VOCAB))
        reference = reference[:, model.draft_vocab]
    for logits in model([features] * 4):
        torch.testing.assert_close(logits, reference)
    assert model.medusa_head[0][-1].weight.data_ptr() != target.lm_head.weight.data_ptr()  # a copy, not a tie
    if draft_vocab_size:
        with pytest.raises(RuntimeError, match="fit_data must run before init_from_target"):
            model.fit_data(torch.ones(VOCAB))


def test_init_refuses_another_targets_lm_head(target):
    model = get_family("medusa").build(target.config, {})
    with pytest.raises(ValueError, match="build them for this target"):
        model.init_from_target(FrozenTarget(nn.Embedding(5, 8), nn.Linear(8, 5, bias=False)))


def test_gradients_reach_only_the_heads(target):
    batch = self_distilled_batch(target, VOCAB, n=3, new_tokens=8)
    model = build(target)
    frozen = FrozenTarget.from_model(target)
    out = medusa_loss(model, batch, frozen, soft_labels=True)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert all(p.grad is None for p in target.parameters())
    assert {"loss/head1", "acc/head1", "acc/head4", "sim/accept_length"} <= set(out.metrics)


@pytest.mark.parametrize("soft_labels", [False, True])
def test_overfits_one_batch(target, soft_labels):
    batch = self_distilled_batch(target, VOCAB, n=4, new_tokens=12)
    torch.manual_seed(0)
    model = build(target)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses, accuracy = [], []
    for _ in range(60):
        out = medusa_loss(model, batch, FrozenTarget.from_model(target), soft_labels=soft_labels)
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        losses.append(float(out.loss.detach()))
        accuracy.append(sum(out.metrics[f"acc/head{k}"] for k in range(1, 5)) / 4)
    if soft_labels:  # the floor is the teacher's entropy (high for a random target): the heads must match it
        assert losses[-1] < losses[0] and accuracy[-1] > accuracy[0] + 0.25
    else:
        assert losses[-1] < 0.5 * losses[0] and accuracy[-1] > accuracy[0] + 0.3


class _PositionHeads(nn.Module):
    """A stub with the MedusaHeads interface: feature[0] holds the position t; head k predicts token
    ``BASE + t + offset + k`` and records which positions it was given."""

    def __init__(self, heads, vocab, offset):
        super().__init__()
        self.config = MedusaConfig(hidden_size=4, vocab_size=vocab, num_heads=heads)
        self.offset, self.vocab, self.seen = offset, vocab, {}
        self.scale = nn.Parameter(torch.ones(()))

    def vocab_index(self, vocab_size):
        return None

    def forward(self, per_head):
        out = []
        for k, x in enumerate(per_head, start=1):
            self.seen[k] = sorted(int(t) for t in x[:, 0])
            guess = (BASE + x[:, 0].long() + self.offset + k).clamp(max=self.vocab - 1)
            out.append(nn.functional.one_hot(guess, self.vocab).float() * 20 * self.scale)
        return out


BASE = 10


def test_head_k_at_position_t_is_supervised_on_token_t_plus_k_plus_1():
    T, K, first_supervised = 12, 4, 5
    ids = (BASE + torch.arange(T))[None]  # x_p = BASE + p, all distinct
    loss_mask = (torch.arange(T) >= first_supervised).float()[None]
    features = torch.zeros(1, T, 4)
    features[0, :, 0] = torch.arange(T).float()
    batch = TrainBatch(ids, loss_mask, torch.ones(1, T, dtype=torch.long), features)
    frozen = FrozenTarget(nn.Embedding(64, 4), nn.Linear(4, 64, bias=False))
    right = _PositionHeads(K, 64, offset=1)
    out = medusa_loss(right, batch, frozen)
    for k in range(1, K + 1):
        # position t supervised iff its label x_{t+k+1} exists and is an assistant token
        assert right.seen[k] == [t for t in range(T) if first_supervised <= t + k + 1 < T]
        assert out.metrics[f"acc/head{k}"] == 1.0
    leading = [min(K, T - 2 - t) for t in right.seen[1]]
    assert out.metrics["sim/accept_length"] == pytest.approx(1 + sum(leading) / len(leading))
    off_by_one = medusa_loss(_PositionHeads(K, 64, offset=0), batch, frozen)  # predicts x_{t+k}
    assert all(off_by_one.metrics[f"acc/head{k}"] == 0.0 for k in range(1, K + 1))
    assert off_by_one.metrics["sim/accept_length"] == 1.0 and off_by_one.loss > out.loss


def test_soft_labels_read_the_target_at_position_t_plus_k():
    """A target whose lm_head at position s is sharply peaked on x_{s+1}: soft labels must then equal
    hard labels, which holds only if the teacher for head k at t is read at s = t + k."""
    vocab, T = 32, 14
    ids = torch.randperm(vocab)[:T][None]
    features = torch.zeros(1, T, vocab)
    features[0, torch.arange(T - 1), ids[0, 1:]] = 1.0  # f_s points at x_{s+1}
    frozen = FrozenTarget(nn.Embedding(vocab, vocab), nn.Linear(vocab, vocab, bias=False))
    with torch.no_grad():
        frozen.lm_head.weight.copy_(60 * torch.eye(vocab))
    torch.manual_seed(0)
    model = MedusaHeads(MedusaConfig(hidden_size=vocab, vocab_size=vocab, num_heads=3))
    with torch.no_grad():
        for head in model.medusa_head:
            head[-1].weight.normal_()
    batch = TrainBatch(ids, torch.ones(1, T), torch.ones(1, T, dtype=torch.long), features)
    hard, soft = medusa_loss(model, batch, frozen), medusa_loss(model, batch, frozen, soft_labels=True)
    torch.testing.assert_close(soft.loss, hard.loss, rtol=1e-4, atol=1e-4)


def test_draft_vocabulary_labels_outside_it_are_misses(target):
    batch = self_distilled_batch(target, VOCAB, n=4, new_tokens=12)
    model = get_family("medusa").build(target.config, {"draft_vocab_size": 8})
    model.fit_data(torch.bincount(batch.input_ids[batch.attention_mask.bool()], minlength=VOCAB))
    model.init_from_target(FrozenTarget.from_model(target))
    out = medusa_loss(model, batch, FrozenTarget.from_model(target))
    assert torch.isfinite(out.loss)
    index = model.vocab_index(model.config.vocab_size)
    assert index[model.draft_vocab].tolist() == list(range(8)) and int((index >= 0).sum()) == 8


def test_static_tree_from_choice_paths():
    paths = resolve_tree([[0, 1, 0], [1], [0]], num_heads=4)  # prefixes are added: [0, 1]
    assert paths == [(0,), (1,), (0, 1), (0, 1, 0)]
    tree = StaticTree.from_paths(paths)
    assert tree.parents == (-1, -1, 0, 2) and tree.depths == (1, 1, 2, 3) and tree.ranks == (0, 1, 1, 0)
    assert [tree.top_k(d) for d in (1, 2, 3)] == [2, 2, 1]
    draft = tree.draft([[50, 51], [60, 61], [70]])  # ranked candidates of heads 1..3
    assert draft.tokens.tolist() == [50, 51, 61, 70] and draft.parents.tolist() == [-1, -1, 0, 2]
    for bad, message in (([[0, 0, 0, 0, 0]], "5 deep"), ([[-1]], "not an integer"), ("medusa-7", "unknown")):
        with pytest.raises(MedusaTreeError, match=message):
            resolve_tree(bad, num_heads=4)


def test_shipped_trees_have_their_sizes_and_fit_fewer_heads():
    for name, paths in DEFAULT_TREES.items():
        assert len(resolve_tree(name, 4)) == int(name.split("-")[1])
        assert all(tuple(p[:-1]) in {tuple(q) for q in paths} for p in paths if len(p) > 1)  # prefix-closed
    assert max(len(p) for p in resolve_tree("medusa-64", 2)) == 2
    assert resolve_tree("dynamic", 4) is None


def test_drafter_tree_holds_each_heads_ranked_tokens(target, trained):
    prompt = random_prompts(1, seed=4)[0]
    tokens = prompt + hf_greedy(target, prompt, 3)
    with torch.no_grad():
        features = target.model(torch.tensor([tokens])).last_hidden_state[0, :-1]
    drafter = serve(trained, target, tree=[[0, 0, 0], [1], [0, 2]])
    tree = drafter.propose(DraftContext(tokens, len(prompt), features=features))
    ranked = trained.all_heads(features[-1]).topk(3).indices  # (K, 3)
    expected = [ranked[0, 0], ranked[0, 1], ranked[1, 0], ranked[1, 2], ranked[2, 0]]  # paths sorted
    assert tree.tokens.tolist() == [int(t) for t in expected] and tree.parents.tolist() == [-1, -1, 0, 0, 2]


@pytest.mark.parametrize("budget", [1, 2, 3])
def test_a_small_dynamic_tree_runs_only_the_heads_it_can_reach(target, trained, budget):
    from draftsmith.core.tree import cartesian_tree

    features = torch.randn(5, 64)
    with torch.no_grad():
        every_head = cartesian_tree(trained.all_heads(features[-1]), 3, budget, trained.token_ids)
    drafter = serve(trained, target, tree="dynamic", top_k=3, total_tokens=budget)
    ran = []
    hooks = [head.register_forward_hook(lambda *_, k=k: ran.append(k)) for k, head in enumerate(trained.medusa_head)]
    try:
        tree = drafter.propose(DraftContext(list(range(10, 16)), 3, features=features))
    finally:
        for hook in hooks:
            hook.remove()
    assert tree.tokens.tolist() == every_head.tokens.tolist() and tree.parents.tolist() == every_head.parents.tolist()
    assert sorted(ran) == list(range(min(budget, trained.config.num_heads)))


def test_dynamic_tree_is_the_best_paths_by_cumulative_log_probability(target, trained):
    features = torch.randn(5, 64)
    drafter = serve(trained, target, tree="dynamic", top_k=3, total_tokens=7)
    tree = drafter.propose(DraftContext(list(range(10, 16)), 3, features=features))
    with torch.no_grad():
        top = trained.all_heads(features[-1]).log_softmax(-1).topk(3)
    # brute force over all 3 + 9 + 27 + 81 paths of top-3 ranks
    scored, frontier = [], [((), 0.0)]
    for depth in range(4):
        frontier = [(p + (r,), s + float(top.values[depth, r].detach())) for p, s in frontier for r in range(3)]
        scored += frontier
    best = sorted(scored, key=lambda x: -x[1])[:7]
    expected = sorted(tuple(int(top.indices[d, r]) for d, r in enumerate(p)) for p, _ in best)
    depths, paths = tree.depths().tolist(), []
    for i in range(len(tree)):
        path, node = [], i
        while node >= 0:
            path.insert(0, int(tree.tokens[node]))
            node = int(tree.parents[node])
        paths.append(tuple(path))
    assert len(tree) == 7 and sorted(paths) == expected and depths == sorted(depths)


def test_calibration_prefers_the_more_accurate_paths():
    accuracy = [[0.5, 0.3], [0.1, 0.6], [0.4, 0.1]]
    assert calibrated_paths(accuracy, 1) == [[0]]
    assert calibrated_paths(accuracy, 3) == [[0], [1], [0, 1]]  # 0.5*0.6 = .30 beats rank 0 of head 2 (.05)
    assert calibrated_paths(accuracy, 4) == [[0], [1], [0, 1], [1, 1]]  # .18 next, then [0, 1, 0] = .12
    assert expected_accept_length([[0], [0, 1]], accuracy) == pytest.approx(1 + 0.5 + 0.3)
    four_heads = accuracy + [[0.2, 0.3]]
    for nodes in (8, 16):  # on its own accuracies, the calibrated tree beats the default of the same size
        default = DEFAULT_TREES[f"medusa-{nodes}"]
        calibrated = calibrated_paths(four_heads, nodes)
        assert len(calibrated) == len(default) == nodes
        assert expected_accept_length(calibrated, four_heads) > expected_accept_length(default, four_heads)


def test_held_out_split_is_the_trainers():
    from draftsmith.train.loader import TrainData
    from draftsmith.train.medusa_calibrate import held_out_indices

    class Fake:
        def __len__(self):
            return 50

    assert held_out_indices(50, 7) == TrainData(Fake(), eval_samples=7).eval_indices
    with pytest.raises(MedusaTreeError, match="--samples must be between 1 and 49"):
        held_out_indices(50, 50)


@pytest.mark.parametrize("which", ["random", "trained"])
def test_static_and_dynamic_trees_decode_losslessly(target, trained, which):
    model = trained if which == "trained" else get_family("medusa").build(target.config, {})  # random heads
    taus = []
    for tree in ("medusa-16", "dynamic"):
        drafter = serve(model, target, tree=tree, total_tokens=10)
        produced = forwards = 0
        for prompt in random_prompts(8, seed=11):
            result = generate(target, prompt, drafter, max_new_tokens=40, eos_token_ids=[EOS])
            assert result.tokens == hf_greedy(target, prompt, 40)
            produced, forwards = produced + len(result.tokens), forwards + result.target_forwards
        taus.append(produced / forwards)
    if which == "trained":  # prompts like its training prompts: the heads' trees really get accepted
        assert min(taus) > 1.3


def test_an_exported_medusa_keeps_its_tree_and_the_engines_tensor_names(target, trained, tmp_path):
    identity = {"name": "t", "revision": "r", "config_hash": "c", "tokenizer_hash": "k"}
    export_drafter(trained, identity, tmp_path / "m")
    loaded = MedusaHeads.from_pretrained(tmp_path / "m").eval()
    assert loaded.config.drafter_family == "medusa" and loaded.config.tree == "medusa-16"
    features = torch.randn(3, 64)
    torch.testing.assert_close(loaded.all_heads(features), trained.all_heads(features))
    from safetensors.torch import load_file

    keys = set(load_file(str(tmp_path / "m" / "model.safetensors")))
    assert {"medusa_head.0.0.linear.weight", "medusa_head.0.0.linear.bias", "medusa_head.3.1.weight"} <= keys


def test_recipe_parses_and_bad_options_are_recipe_errors(target):
    from draftsmith.train.recipe import load_train_recipe

    recipe = load_train_recipe(REPO / "recipes" / "medusa1-smollm2.yaml")
    assert recipe.family_name == "medusa" and recipe.loss == {"decay": 0.8, "soft_labels": False}
    with pytest.raises(UnknownOptionError, match="did you mean 'num_heads'"):
        get_family("medusa").build(target.config, {"num_head": 3})
    with pytest.raises(RecipeError, match="loss.decya"):
        check_loss_options(get_family("medusa"), {"decya": 0.8})
    with pytest.raises(MedusaTreeError, match="unknown Medusa tree"):
        get_family("medusa").build(target.config, {"tree": "big"})


@pytest.fixture(scope="module")
def medusa_export(tmp_path_factory, tiny_target_dir):
    """A Medusa drafter trained for two steps by the real trainer on a tiny prepared dataset, exported."""
    from draftsmith.cli import main

    root = tmp_path_factory.mktemp("medusa-run")
    prepare_arithmetic_chats(root / "prepared", tiny_target_dir, 12)
    recipe = {
        "target": {"name": str(tiny_target_dir)},
        "output_dir": str(root / "run"),
        "data": {"prepared": str(root / "prepared"), "eval_samples": 4},
        "drafter": {"family": "medusa", "num_heads": 3, "tree": "medusa-8"},
        "loss": {"decay": 0.8},
        "train": {"lr": 1e-3, "batch_size": 2, "max_steps": 2, "save_every": 2, "log_every": 1},
        "tracking": {"wandb": False},
    }
    (root / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    main(["train", str(root / "recipe.yaml")])
    main(["export", str(root / "run"), "--out", str(root / "export")])
    return root


def test_trained_export_calibrates_and_decodes_losslessly(medusa_export, tiny_target_dir, capsys):
    from draftsmith.cli import main
    from draftsmith.core.target import load_target
    from draftsmith.inference.methods.table import build_drafter

    root, export = medusa_export, medusa_export / "export"

    def calibrate(*out):
        data = ["--data", str(root / "prepared"), "--nodes", "6", "--samples", "4"]
        main(["medusa", "calibrate", str(export), *data, "--target", str(tiny_target_dir), *out])

    calibrate("--out", str(root / "tree.json"))
    written = json.loads((root / "tree.json").read_text())
    assert written["format"] == "draftsmith.medusa_tree/1" and len(written["paths"]) == written["nodes"] == 6
    assert len(written["head_accuracy"]) == 3 and all(len(row) == 10 for row in written["head_accuracy"])
    assert json.loads((export / "config.json").read_text())["tree"] == "medusa-8"  # --out leaves the drafter as is
    calibrate()
    assert "6-node tree" in capsys.readouterr().out
    config = json.loads((export / "config.json").read_text())
    assert config["tree"] == written["paths"] and config["tree_calibration"]["nodes"] == 6
    tiny = load_target(str(tiny_target_dir))
    drafter = build_drafter(f"medusa={export}", tiny)
    assert (
        drafter.wants_features
        and drafter.name == "medusa"
        and drafter.static.paths == tuple(tuple(p) for p in written["paths"])
    )
    prompt = tiny.encode_chat([{"role": "user", "content": "Question 3: what is 3 plus 3?"}])
    result = generate(tiny.model, prompt, drafter, max_new_tokens=24, eos_token_ids=tiny.eos_token_ids)
    reference = tiny.model.generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=24, eos_token_id=tiny.eos_token_ids, pad_token_id=0
    )[0, len(prompt) :].tolist()
    assert result.tokens == reference


def test_a_shipped_tree_can_replace_the_exported_one_at_serve_time(medusa_export, tiny_target_dir):
    """``medusa=DIR:tree=medusa-16`` against ``medusa=DIR`` compares a calibrated tree with a default one."""
    from draftsmith.core.target import load_target
    from draftsmith.drafters.base import TreeOptionError
    from draftsmith.inference.methods.table import build_drafter, split_tree_options

    export = medusa_export / "export"
    assert split_tree_options("d:tree=medusa-16:top_k=3") == ("d", {"tree": "medusa-16", "top_k": "3"})
    tiny = load_target(str(tiny_target_dir))
    drafter = build_drafter(f"medusa={export}:tree=medusa-16", tiny)
    assert drafter.static.paths == tuple(resolve_tree("medusa-16", 3))  # not DIR/config.json's tree
    assert build_drafter(f"medusa={export}:tree=dynamic:total_tokens=6", tiny).static is None
    with pytest.raises(TreeOptionError, match="tree takes a tree name"):
        build_drafter(f"medusa={export}:tree=16", tiny)
    with pytest.raises(TreeOptionError, match="top_k takes a whole number"):
        build_drafter(f"medusa={export}:top_k=many", tiny)
    with pytest.raises(MedusaTreeError, match="unknown Medusa tree"):
        build_drafter(f"medusa={export}:tree=medusa-7", tiny)


def test_calibrate_refuses_other_families(medusa_export, tiny_target_dir, tmp_path, capsys):
    from draftsmith.cli import main

    eagle = get_family("eagle").build(tiny_llama(VOCAB).config, {})
    export_drafter(eagle, {"name": "t", "revision": "r", "config_hash": "c", "tokenizer_hash": "k"}, tmp_path / "e")
    with pytest.raises(SystemExit):
        main(["medusa", "calibrate", str(tmp_path / "e"), "--data", str(medusa_export / "prepared"), "--nodes", "4"])
    assert "holds a 'eagle' drafter; calibrate works on medusa" in capsys.readouterr().err


def test_the_trainer_starts_heads_from_lm_head(medusa_export, tiny_target_dir):
    """Two Adam steps at lr 1e-3 move a weight by ~2e-3; a head not copied from lm_head would sit ~0.1 away."""
    from safetensors.torch import load_file

    from draftsmith.core.target import load_target

    weights = load_file(str(medusa_export / "export" / "model.safetensors"))
    lm_head = load_target(str(tiny_target_dir)).model.lm_head.weight
    for k in range(3):
        assert (weights[f"medusa_head.{k}.1.weight"] - lm_head).abs().max() < 0.01
