"""Speculative Streaming's tree-pruning adapter: its shape, what it prunes, lossless decoding with it,
export / load, and training it jointly with the streams or afterwards (everything else frozen)."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import DynamicCache

from draftsmith.core.tree import DraftTree, tree_attention_inputs
from draftsmith.drafters.streaming import MAIN_STREAM_ONLY, StreamingConfigError, StreamingModel, StreamingPass
from draftsmith.drafters.tree_pruning import TreePruning, surviving_rows, transition_probabilities, tree_parents
from draftsmith.inference.runtime import generate
from draftsmith.train.losses.streaming import streaming_loss
from helpers import STREAMING_VOCAB as VOCAB
from helpers import TINY_EOS as EOS
from helpers import (
    batch_of,
    hf_greedy,
    make_streaming,
    serve,
    streaming_prompts,
    train_streams,
)
from helpers import streaming_target as make_target

H = 64  # the tiny target's hidden size


def pruned_model(seed: int = 0, **options) -> StreamingModel:
    return make_streaming(make_target(seed), pruning_rank=8, **options)


# ---- the adapter --------------------------------------------------------------------------------
def test_adapter_is_a_rank_r_map_into_the_lm_head():
    model = pruned_model()
    down, up = model.pruning[0].weight, model.pruning[1].weight
    assert down.shape == (8, H) and up.shape == (H, 8) and not up.any()  # starts at 0, as LoRA's B
    assert make_streaming(make_target(), pruning_rank=3).pruning[0].weight.shape == (3, H)
    counts = model.parameter_counts()
    assert counts["streams"] == 3 * H and counts["pruning"] == 2 * 8 * H
    assert counts["lora"] == sum(p.numel() for p in model.lora.parameters())
    ids = torch.randint(4, VOCAB, (2, 9))
    with torch.no_grad():
        out = model(ids)
        states = model(ids, output_hidden_states=True, mode=MAIN_STREAM_ONLY).hidden_states
        main = states[model.config.first_stream_layer]
    assert out.pruning_hidden.shape == (2, 9, H)
    torch.testing.assert_close(out.pruning_hidden, model.early_exit(main), rtol=0, atol=1e-6)  # o_θ(M^{L-Ns})
    assert model.early_exit_logits(main).shape == (2, 9, VOCAB)
    assert "pruning" not in make_streaming(make_target()).parameter_counts()


def test_the_exit_starts_as_the_logit_lens_and_old_exports_keep_the_linear_one(tmp_path):
    """``lens``: an untrained adapter is the target's own early exit (final norm, lm_head) at L - Ns, and
    training adds a low-rank correction of the normed state; ``linear`` (the paper's ``B(A(M))``, and
    every export made before the option) starts uniform."""
    lens, linear = pruned_model(), pruned_model(pruning_exit="linear")
    target = lens.target
    main = torch.randn(2, 5, H) * 30.0
    with torch.no_grad():
        torch.testing.assert_close(lens.early_exit_logits(main), target.lm_head(target.model.norm(main)))
        assert not linear.early_exit_logits(main).any()  # B = 0: every token equally likely
        lens.pruning[1].weight.normal_(std=0.1)
        normed = target.model.norm(main)
        torch.testing.assert_close(lens.early_exit(main), normed + lens.pruning(normed))
    with pytest.raises(StreamingConfigError, match="pruning_exit"):
        pruned_model(pruning_exit="logits")
    lens.config.save_pretrained(str(tmp_path))
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["pruning_exit"] == "lens"
    del written["pruning_exit"]  # as exports made before the option were written
    (tmp_path / "config.json").write_text(json.dumps(written))
    assert type(lens.config).from_pretrained(str(tmp_path)).pruning_exit == "linear"


def test_options_that_need_the_adapter_are_refused():
    target = make_target()
    with pytest.raises(StreamingConfigError, match="pruning_rank"):
        make_streaming(target, prune=0.1)
    with pytest.raises(StreamingConfigError, match="pruning_rank"):
        make_streaming(make_target(), train_pruning_only=True)
    plain = make_streaming(target)
    with pytest.raises(StreamingConfigError, match="pruning adapter"):
        serve(plain, target, prune=0.1)


# ---- what is pruned -----------------------------------------------------------------------------
def test_parents_come_from_the_tree_mask():
    tree = DraftTree.from_paths([[40, 41, 42], [40, 50], [60, 61, 62, 63]])
    mask, _ = tree_attention_inputs(tree, past_length=5, dtype=torch.float32)
    allowed = mask[0, 0, :, 5:] == 0
    assert tree_parents(allowed).tolist() == [-1] + [p + 1 for p in tree.parents.tolist()]


def test_a_pruned_node_takes_its_subtree_and_the_root_stays():
    # rows: 0 root; 1, 2 under the root; 3 under 1; 4 under 2; 5 under 4
    parents = [-1, 0, 0, 1, 2, 4]
    probs = torch.tensor([1.0, 0.9, 0.01, 0.5, 0.9, 0.9])
    assert surviving_rows(probs, parents, 0.05) == [0, 1, 3]  # 4 and 5 are likely, but under the pruned 2
    assert surviving_rows(probs, parents, 0.0) == list(range(6))
    assert surviving_rows(probs, parents, 0.95) == [0]
    kept = surviving_rows(torch.rand(6), parents, 0.3)
    assert kept[0] == 0 and all(parents[row] in kept for row in kept[1:])  # no orphans


def test_pruned_forward_is_the_full_forward_restricted_to_the_kept_rows():
    model = pruned_model(seed=2)
    with torch.no_grad():
        model.pruning[1].weight.normal_(std=3.0)  # a decisive adapter, so a threshold splits the tree
    prefix = [5, 9, 14, 33, 7]
    tree = DraftTree.from_paths([[40, 41, 42], [40, 50], [60, 61], [70], [80, 81]])
    mask, positions = tree_attention_inputs(tree, len(prefix) - 1, torch.float32)
    ids = torch.cat([torch.tensor(prefix[-1:]), tree.tokens])[None]
    first = model.config.first_stream_layer

    def run(threshold):
        cache = DynamicCache(config=model.target.config)
        with torch.no_grad():
            model(torch.tensor([prefix[:-1]]), cache=cache)
            out = model(
                ids,
                attention_mask=mask,
                position_ids=positions,
                cache=cache,
                output_hidden_states=not threshold,
                mode=StreamingPass(prune_threshold=threshold),
            )
        return out, cache

    full, _ = run(0.0)
    pruning = TreePruning.from_mask(mask[0, 0] == 0, ids[0], len(prefix) - 1, 0.5)
    probs = transition_probabilities(model.early_exit_logits, full.hidden_states[first][0], pruning)
    threshold = float(probs[1:].median())  # about half of the nodes are under it
    expected = surviving_rows(probs, pruning.parents, threshold)
    assert 1 < len(expected) < ids.shape[1]
    pruned, cache = run(threshold)
    assert pruned.kept_rows.tolist() == expected
    rows = pruned.kept_rows
    torch.testing.assert_close(pruned.logits[0], full.logits[0, rows], rtol=0, atol=2e-5)
    torch.testing.assert_close(pruned.stream_hidden[0], full.stream_hidden[0, rows], rtol=0, atol=2e-5)
    assert {layer.keys.shape[-2] for layer in cache.layers} == {len(prefix) - 1 + len(expected)}


# ---- decoding -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained():
    """Streams and adapter trained together on the adapted target's own greedy continuations."""
    target = make_target(seed=4)
    model = make_streaming(target, lora_noise=0.02, pruning_rank=8)
    with model.adapted() as adapted:
        prompts = streaming_prompts(12, seed=5)
        seqs = [p + hf_greedy(adapted, p, 30) for p in prompts]
    model, history = train_streams(target, model, prompts, seqs, steps=150)
    assert history[-1].metrics["acc/pruning"] > history[0].metrics["acc/pruning"] + 0.3
    return target, model


def test_greedy_decoding_with_pruning_is_lossless_and_verifies_fewer_rows(trained):
    target, model = trained
    drafter = serve(model, target, top_k=3, total_tokens=10, prune=0.1)
    sizes = []  # (rows given, rows kept) of every tree forward
    server_forward = drafter.verifier.forward

    def counting_forward(input_ids, **kwargs):
        out = server_forward(input_ids, **kwargs)
        if kwargs.get("attention_mask") is not None:
            sizes.append((input_ids.shape[1], input_ids.shape[1] if out.kept_rows is None else len(out.kept_rows)))
        return out

    drafter.verifier.forward = counting_forward
    taus = []
    for prompt in streaming_prompts(12, seed=5) + streaming_prompts(8, seed=99):
        with model.adapted() as adapted:
            reference = hf_greedy(adapted, prompt, 30)
        result = generate(target, prompt, drafter, max_new_tokens=30, eos_token_ids=[EOS])
        assert result.tokens == reference, prompt
        taus.append(result.tau)
    assert any(1 < kept < given for given, kept in sizes)  # sub-trees were dropped, not whole trees only
    assert sum(kept for _, kept in sizes) < sum(given for given, _ in sizes)
    assert max(taus) > 1.5  # what is left still drafts accepted tokens


def test_sampled_decoding_with_pruning_is_reproducible(trained):
    from helpers import sampled_twice

    target, model = trained
    first, second = sampled_twice(target, serve(model, target, prune=0.1), streaming_prompts(1, seed=7)[0])
    assert first == second and len(first) > 0


# ---- training -----------------------------------------------------------------------------------
def test_the_adapter_loss_trains_the_adapter_alone():
    model = pruned_model(seed=3).train()
    with torch.no_grad():
        model.pruning[1].weight.normal_(std=0.1)  # else A's gradient is 0 while B is
    batch = batch_of([[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16]])
    out = streaming_loss(model, batch, None, main_weight=0.0, stream_weight=0.0, pruning_weight=1.0, kl_weight=0.0)
    assert torch.isfinite(out.loss) and {"loss/pruning", "acc/pruning"} <= set(out.metrics)
    out.loss.backward()
    for name, parameter in model.named_parameters():
        reached = parameter.grad is not None and bool(parameter.grad.abs().sum() > 0)
        assert reached == name.startswith("pruning."), name  # its input is detached: nothing below it learns


def test_train_pruning_only_freezes_the_lora_and_the_streams():
    model = pruned_model(train_pruning_only=True)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"pruning.0.weight", "pruning.1.weight"}
    with torch.no_grad():
        model(torch.randint(4, VOCAB, (1, 6)))  # the adapters' on/off switch leaves trainability alone
    assert {name for name, p in model.named_parameters() if p.requires_grad} == trainable


def _recipe(tmp_path, tiny_target_dir, name: str, drafter: dict, train: dict | None = None):
    recipe = {
        "target": {"name": str(tiny_target_dir)},
        "output_dir": str(tmp_path / name),
        "data": {"prepared": str(tmp_path / "prep"), "eval_samples": 2},
        "drafter": {"family": "streaming", "num_streams": 2, "num_stream_layers": 1, "lora_rank": 4, **drafter},
        "train": {"lr": 1e-2, "batch_size": 2, "max_steps": 3, "save_every": 3, "log_every": 1, **(train or {})},
        "tracking": {"wandb": False},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


def test_joint_then_afterwards_training_export_and_decode(tmp_path, tiny_target_dir, capsys):
    from draftsmith.cli import main
    from draftsmith.core.target import load_target
    from draftsmith.inference.methods.table import build_drafter
    from helpers import prepare_arithmetic_chats

    prepare_arithmetic_chats(tmp_path / "prep", tiny_target_dir, 10)
    # jointly: the adapter trains in the streams' run
    main(["train", _recipe(tmp_path, tiny_target_dir, "joint", {"pruning_rank": 8})])
    metrics = [json.loads(line) for line in (tmp_path / "joint/metrics.jsonl").read_text().splitlines()]
    assert any("loss/pruning" in record for record in metrics)
    main(["export", str(tmp_path / "joint"), "--out", str(tmp_path / "joint-export")])
    assert "streams 128, pruning 1,024, lora" in capsys.readouterr().out  # γ·h, 2·8·h, then the LoRA
    # afterwards: the adapter trains on from the exported run, everything else frozen
    drafter = {"pruning_rank": 8, "prune": 0.01, "train_pruning_only": True}
    main(["train", _recipe(tmp_path, tiny_target_dir, "after", drafter, {"init_from": str(tmp_path / "joint-export")})])
    main(["export", str(tmp_path / "after"), "--out", str(tmp_path / "after-export")])
    before = load_file(str(tmp_path / "joint-export/model.safetensors"))
    after = load_file(str(tmp_path / "after-export/model.safetensors"))
    assert {k for k in after if not k.startswith("pruning.")} == {k for k in before if not k.startswith("pruning.")}
    assert all(torch.equal(after[k], before[k]) for k in after if not k.startswith("pruning."))
    assert not torch.equal(after["pruning.1.weight"], before["pruning.1.weight"])
    # the runtime loads the adapter and the threshold (the recipe's default, or the method's option)
    tiny = load_target(str(tiny_target_dir))
    loaded = build_drafter(f"streaming={tmp_path / 'after-export'}", tiny)
    assert loaded.prune == 0.01 and torch.equal(loaded.adapting.pruning[1].weight, after["pruning.1.weight"])
    drafter = build_drafter(f"streaming={tmp_path / 'after-export'}:prune=0.2:top_k=2", tiny)
    assert drafter.prune == 0.2 and drafter.top_k == 2
    prompt = tiny.encode_chat([{"role": "user", "content": "Question 3: what is 3 plus 3?"}])
    result = generate(tiny.model, prompt, drafter, max_new_tokens=16, eos_token_ids=tiny.eos_token_ids)
    with drafter.reference_model() as adapted:
        assert result.tokens == hf_greedy(adapted, prompt, 16, tiny.eos_token_ids)


def test_init_from_fills_what_fits_and_refuses_other_options(tmp_path):
    from draftsmith.drafters.io import DrafterCheckpointError, load_weights_into

    without = make_streaming(make_target(), seed=5)
    without.save_pretrained(str(tmp_path / "streams"))
    model = make_streaming(make_target(), pruning_rank=8)
    assert load_weights_into(model, tmp_path / "streams") == ["pruning.0.weight", "pruning.1.weight"]  # start fresh
    assert torch.equal(model.stream_embeddings, without.stream_embeddings)
    model.save_pretrained(str(tmp_path / "all"))
    with pytest.raises(DrafterCheckpointError, match="stream_embeddings"):
        load_weights_into(make_streaming(make_target(), pruning_rank=8, num_streams=2), tmp_path / "all")
    with pytest.raises(DrafterCheckpointError, match="pruning"):
        load_weights_into(make_streaming(make_target()), tmp_path / "all")


def test_prune_option_must_be_a_fraction():
    from draftsmith.drafters.base import TreeOptionError
    from draftsmith.inference.methods.table import build_drafter, split_tree_options

    assert split_tree_options("runs/x:prune=0.05:top_k=2") == ("runs/x", {"prune": "0.05", "top_k": "2"})
    for bad in ("1.5", "abc"):
        with pytest.raises(TreeOptionError, match="prune"):
            build_drafter(f"streaming=runs/x:prune={bad}", None)
    with pytest.raises(TreeOptionError, match="no tree option prune"):
        build_drafter("eagle=runs/x:prune=0.1", None)
