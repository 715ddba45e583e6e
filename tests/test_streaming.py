"""Speculative Streaming: multi-stream attention inside a tiny random Llama, its loss, save/load, the
trainer and export path, and lossless decoding with the LoRA-adapted target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import DynamicCache

from conftest import tiny_gemma3, tiny_llama
from draftsmith.core.tree import DraftTree, best_first_tree, cartesian_tree, tree_attention_inputs
from draftsmith.drafters.streaming import (
    MAIN_STREAM_ONLY,
    StreamingConfig,
    StreamingConfigError,
    StreamingModel,
    StreamingPass,
)
from draftsmith.inference.runtime import generate
from draftsmith.train.losses.streaming import streaming_loss
from helpers import STREAMING_VOCAB as VOCAB
from helpers import TINY_EOS as EOS
from helpers import (
    batch_of,
    hf_greedy,
    make_streaming,
    prepare_arithmetic_chats,
    serve,
    streaming_prompts,
    train_streams,
)
from helpers import streaming_target as make_target

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture()
def pair():
    target = make_target()
    return target, make_streaming(target)


# ---- the model ------------------------------------------------------------------------------------
def test_main_stream_is_exactly_the_adapted_model(pair):
    target, model = pair
    ids = torch.randint(4, VOCAB, (2, 11))
    with torch.no_grad():
        original = target(ids).logits
        with model.adapted() as adapted_target:
            adapted = adapted_target(ids).logits
        on, off = model(ids), model(ids, mode=MAIN_STREAM_ONLY)
    assert not torch.allclose(adapted, original, atol=1e-3)  # the LoRA does change the model
    assert torch.equal(off.logits, adapted) and off.stream_hidden is None
    assert torch.equal(on.logits, adapted)  # the hooks only read: the main stream is untouched
    assert on.stream_hidden.shape == (2, 11, 3, 64)
    with torch.no_grad():
        assert torch.equal(target(ids).logits, original)  # outside the model the target is the original


def test_streams_at_t_ignore_tokens_after_t(pair):
    _, model = pair
    ids = torch.randint(4, VOCAB, (1, 12))
    changed = ids.clone()
    t = 6
    changed[0, t + 1 :] = (changed[0, t + 1 :] + 7) % (VOCAB - 4) + 4
    with torch.no_grad():
        a, b = model(ids).stream_hidden, model(changed).stream_hidden
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :], atol=1e-3)  # the change does reach later rows


def test_stream_j_ignores_later_streams(pair):
    _, model = pair
    ids = torch.randint(4, VOCAB, (1, 9))
    with torch.no_grad():
        before = model(ids).stream_hidden
        model.stream_embeddings[1] += 1.0  # perturb stream 2 (0-based 1)
        after = model(ids).stream_hidden
    torch.testing.assert_close(before[:, :, 0], after[:, :, 0], rtol=0, atol=1e-6)  # stream 1 sees only itself
    assert not torch.allclose(before[:, :, 1], after[:, :, 1], atol=1e-3)  # stream 2 changed
    assert not torch.allclose(before[:, :, 2], after[:, :, 2], atol=1e-3)  # stream 3 attends to stream 2


def test_streams_never_enter_the_cache_and_tree_rows_match_their_paths(pair):
    """Streams at a tree node (tree mask on top of a cached prefix) equal the streams at the same
    position of the node's own path run as a plain sequence."""
    _, model = pair
    prefix = [5, 9, 14, 33, 7]
    tree = DraftTree.from_paths([[40, 41, 42], [40, 50], [60, 61]])
    cache = DynamicCache(config=model.target.config)
    with torch.no_grad():
        model(torch.tensor([prefix[:-1]]), cache=cache)
        assert cache.get_seq_length() == len(prefix) - 1
        mask, positions = tree_attention_inputs(tree, len(prefix) - 1, torch.float32)
        ids = torch.cat([torch.tensor(prefix[-1:]), tree.tokens])[None]
        out = model(ids, attention_mask=mask, position_ids=positions, cache=cache)
        assert cache.get_seq_length() == len(prefix) - 1 + ids.shape[1]  # main rows only, no stream rows
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        for node in range(len(tree)):
            path, current = [], node
            while current >= 0:
                path.insert(0, tokens[current])
                current = parents[current]
            plain = model(torch.tensor([prefix + path]))
            torch.testing.assert_close(out.stream_hidden[0, node + 1], plain.stream_hidden[0, -1], rtol=0, atol=2e-5)
            torch.testing.assert_close(out.logits[0, node + 1], plain.logits[0, -1], rtol=0, atol=2e-5)


def test_prompt_rows_select_streams(pair):
    _, model = pair
    ids = torch.randint(4, VOCAB, (1, 8))
    with torch.no_grad():
        full = model(ids).stream_hidden
        last = model(ids, mode=StreamingPass(stream_rows=torch.tensor([7]))).stream_hidden
    torch.testing.assert_close(last[:, 0], full[:, 7], rtol=0, atol=1e-6)


def test_a_lone_stream_on_gemma3_computes_what_its_decoder_layer_computes():
    """One stream holding the main stream's own input at row t is that row's query: against the cached
    main keys it may see, its own key and value at t left out (the stream brings them itself), each
    layer's stream_layer gives that Gemma-3 layer's output at t. Row t lies past the sliding window,
    so this needs the QK-norm, the query_pre_attn_scalar scaling, the norms around attention and MLP,
    the window and each layer type's own RoPE (taken from the kwargs HF hands the layer, as the hook does)."""
    from draftsmith.drafters.streaming import _main_stream_allowed, stream_layer

    target = tiny_gemma3(VOCAB)  # layer 0 sliding (window 8), layer 1 full attention
    ids, t = torch.randint(4, VOCAB, (1, 14)), 12  # row 12's window starts at column 5
    calls = {}

    def keep_call(index):
        def hook(module, args, kwargs, output):
            calls[index] = (args[0] if args else kwargs["hidden_states"], kwargs["position_embeddings"], output)

        return hook

    layers = target.model.layers
    hooks = [layer.register_forward_hook(keep_call(i), with_kwargs=True) for i, layer in enumerate(layers)]
    cache = DynamicCache()
    with torch.no_grad():
        target(ids, cache=cache)
        for hook in hooks:
            hook.remove()
        allowed = _main_stream_allowed(target.config, None, ids.shape, 0, ids.device)
        for index, layer in enumerate(layers):
            hidden, (cos, sin), output = calls[index]
            seen = allowed[target.config.layer_types[index]][:, [t]].clone()
            seen[..., t] = False
            keys, values = cache.layers[index].keys, cache.layers[index].values
            stream = stream_layer(layer, hidden[:, [t], None], keys, values, cos[:, [t]], sin[:, [t]], seen)
            torch.testing.assert_close(stream[0, 0, 0], output[0, t], rtol=0, atol=1e-5)


def test_config_errors_name_the_key():
    target = make_target()
    with pytest.raises(StreamingConfigError, match="num_stream_layers"):
        StreamingConfig.for_target(target.config, num_stream_layers=5)
    with pytest.raises(StreamingConfigError, match="lora_target_modules"):
        StreamingConfig.for_target(target.config, lora_target_modules=["qproj"])
    with pytest.raises(StreamingConfigError, match="pruning"):
        StreamingConfig.for_target(target.config, prune=0.1)  # no adapter to prune with
    model = StreamingModel(StreamingConfig.for_target(target.config, num_stream_layers=2, lora_rank=4))
    narrow = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1}
    other = tiny_llama(VOCAB, num_hidden_layers=4, **narrow)
    with pytest.raises(StreamingConfigError, match="hidden_size"):
        model.attach_target(other)


def test_lora_only_on_chosen_layers_and_modules():
    target = make_target()
    model = make_streaming(target, lora_layers=[3], lora_target_modules=["v_proj", "down_proj"])
    assert sorted(model.lora) == ["layers_3_down_proj", "layers_3_v_proj"]
    assert hasattr(target.model.layers[3].mlp.down_proj, "lora_A")
    assert not hasattr(target.model.layers[2].self_attn.v_proj, "lora_A")
    assert not hasattr(target.model.layers[3].self_attn.q_proj, "lora_A")


# ---- the loss -------------------------------------------------------------------------------------
def test_gradients_reach_only_lora_and_streams(pair):
    target, model = pair
    model.train()
    batch = batch_of([[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16]])
    out = streaming_loss(model, batch, None)
    assert torch.isfinite(out.loss) and {"loss/main", "loss/stream1", "acc/stream3"} <= set(out.metrics)
    out.loss.backward()
    trainable = dict(model.named_parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in trainable.values())
    assert all(p.grad is None for name, p in target.named_parameters() if ".lora_" not in name)
    assert model.parameter_counts() == {"streams": 3 * 64, "lora": sum(p.numel() for p in model.lora.parameters())}


def test_parameter_groups_cover_the_trainable_parameters_in_declared_order():
    from draftsmith.train.recipe import TrainSection
    from draftsmith.train.trainer import optimizer_groups

    target = make_target()
    model = make_streaming(target, pruning_rank=2, stream_init_rank=2)
    groups = optimizer_groups(model, TrainSection(lr=1.0, lr_scale={"lora": 0.1}))
    assert [(g["name"], g["lr"]) for g in groups] == [("streams", 1.0), ("pruning", 1.0), ("lora", 0.1)]
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    pruning_only = make_streaming(target, pruning_rank=2, train_pruning_only=True)
    assert [g["name"] for g in optimizer_groups(pruning_only, TrainSection())] == ["pruning"]  # frozen ones left out


def test_stream_j_at_t_is_supervised_on_token_t_plus_j_plus_1(pair):
    """The vectorised loss against a position-by-position loop."""
    _, model = pair
    seq = [5, 17, 23, 8, 44, 91, 3, 60, 12]
    batch = batch_of([seq])
    batch.loss_mask[0, :3] = 0  # the prompt part
    with torch.no_grad():
        out = streaming_loss(model, batch, None, main_weight=0.0, stream_weight=1.0, kl_weight=0.0)
        hidden = model(batch.input_ids).stream_hidden[0]
    expected = 0.0
    for j in range(1, 4):
        terms = [
            -model.next_token_logits(hidden[t, j - 1]).log_softmax(-1)[seq[t + j + 1]]
            for t in range(len(seq) - j - 1)
            if batch.loss_mask[0, t + j + 1]
        ]
        expected += float(torch.stack(terms).mean())
    assert out.loss.item() == pytest.approx(expected, rel=1e-5)


def test_self_distillation_kl_is_against_the_target_with_the_adapters_off():
    target = make_target()
    batch = batch_of([[5, 17, 23, 8, 44, 91, 3, 60], [12, 13, 14, 15, 16]], [3, 2])
    zero = streaming_loss(make_streaming(target, lora_noise=0.0).train(), batch, None)
    assert zero.metrics["loss/kl"] == pytest.approx(0.0, abs=1e-6) and zero.metrics["agree/original"] == 1.0
    model = make_streaming(make_target(), lora_noise=0.5).train()
    out = streaming_loss(model, batch, None, kl_weight=2.0)
    without = streaming_loss(model, batch, None, kl_weight=0.0)
    assert "loss/kl" not in without.metrics and out.metrics["loss/kl"] > 1e-4
    assert float(out.loss.detach()) == pytest.approx(
        float(without.loss.detach()) + 2.0 * out.metrics["loss/kl"], rel=1e-5
    )
    # the teacher is the plain target: its logits, the KL over the supervised next-token positions
    rows = (batch.loss_mask * batch.attention_mask).bool()[:, 1:]
    with torch.no_grad():
        adapted = model(batch.input_ids, attention_mask=batch.attention_mask, mode=MAIN_STREAM_ONLY).logits
        adapted = adapted[:, :-1][rows]
        original = model.target(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1][rows]
    expected = (original.softmax(-1) * (original.log_softmax(-1) - adapted.log_softmax(-1))).sum(-1).mean()
    assert out.metrics["loss/kl"] == pytest.approx(float(expected), rel=1e-4)
    # only the KL's gradient: it reaches the LoRA and nothing else of the drafter
    model.zero_grad()
    kl_only = streaming_loss(model, batch, None, main_weight=0.0, stream_weight=0.0, pruning_weight=0.0)
    kl_only.loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.lora.parameters())
    assert model.stream_embeddings.grad is None or not model.stream_embeddings.grad.any()


@pytest.mark.parametrize("chunk_rows", [1, 7, 1000])
def test_chunked_logits_give_the_unchunked_loss_and_gradients(chunk_rows):
    """Main, original (KL), stream and adapter logits, chunked: the same loss, metrics and gradients."""
    target = make_target()
    batch = batch_of([[5, 17, 23, 8, 44, 91, 3, 60, 12, 7], [12, 13, 14, 15, 16, 17]], [2, 1])

    def loss_and_grads(rows: int) -> tuple[float, dict[str, torch.Tensor]]:
        model = make_streaming(target, pruning_rank=2).train()
        with torch.no_grad():
            model.pruning[1].weight.normal_(std=0.1)  # a non-zero adapter: its A gets a gradient too
        out = streaming_loss(model, batch, None, stream_weight=1.0, kl_weight=1.0, logit_chunk_rows=rows)
        out.loss.backward()
        return out, {name: p.grad.clone() for name, p in model.named_parameters()}

    reference, reference_grads = loss_and_grads(0)
    chunked, grads = loss_and_grads(chunk_rows)
    assert float(chunked.loss.detach()) == pytest.approx(float(reference.loss.detach()), rel=1e-6)
    assert chunked.metrics == pytest.approx(reference.metrics, rel=1e-5)  # hits (acc/*) included; KL: float order
    assert reference.metrics["loss/kl"] > 1e-6  # the adapter is non-zero: the KL term is exercised
    for name, grad in reference_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("rows", [1, 4])
def test_stream_attention_in_row_chunks_gives_the_same_loss_and_gradients(rows):
    """Stream attention computed a chunk of query rows at a time, checkpointed: the same loss and
    gradients, the LoRA's included (so the recompute in the backward runs with the adapters on)."""
    target = make_target()
    batch = batch_of([[5, 17, 23, 8, 44, 91, 3, 60, 12, 7], [12, 13, 14, 15, 16, 17]], [2, 1])

    def loss_and_grads(chunk: int) -> tuple[float, dict[str, torch.Tensor]]:
        model = make_streaming(target, stream_init_rank=2).train()
        model.STREAM_ROW_CHUNK = chunk
        out = streaming_loss(model, batch, None, stream_weight=1.0, kl_weight=1.0)
        out.loss.backward()
        assert all(layer.disable_adapters for layer in model.lora._peft_layers)  # off again after the recompute
        return float(out.loss.detach()), {name: p.grad.clone() for name, p in model.named_parameters()}

    reference, reference_grads = loss_and_grads(10_000)
    chunked, grads = loss_and_grads(rows)
    assert chunked == pytest.approx(reference, rel=1e-6)
    assert any(grad.abs().sum() > 0 for name, grad in reference_grads.items() if name.startswith("lora."))
    for name, grad in reference_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_chunked_ce_keeps_no_chunk_logits_for_the_backward():
    """Each chunk's logits are made again in the backward (checkpointed), not stored; rows are exact."""
    from draftsmith.train.losses.chunked import chunked_ce

    torch.manual_seed(0)
    head, calls = torch.nn.Linear(8, 50), []
    hidden, labels = torch.randn(23, 8, requires_grad=True), torch.randint(0, 50, (23,))

    def project(x):
        calls.append(x.shape[0])
        return head(x)

    ce, hits = chunked_ce(hidden, labels, project, chunk_rows=7)
    assert calls == [7, 7, 7, 2] and hits.shape == (23,)
    ce.backward()
    assert sorted(calls) == sorted([7, 7, 7, 2] * 2)  # the backward recomputed every chunk
    torch.testing.assert_close(ce, torch.nn.functional.cross_entropy(head(hidden), labels))
    assert torch.equal(hits, head(hidden).argmax(-1) == labels)


def test_overfits_one_batch(pair):
    target, model = pair
    prompts = streaming_prompts(4, seed=3)
    seqs = [p + hf_greedy(target, p, 12) for p in prompts]
    _, history = train_streams(target, model, prompts, seqs, steps=60)
    first, last = history[0].metrics, history[-1].metrics
    # a random tiny target's logits are nearly flat, so CE falls slowly; the argmax agreement moves fast
    assert float(history[-1].loss.detach()) < float(history[0].loss.detach()) - 0.5
    for j in (1, 2, 3):
        assert last[f"acc/stream{j}"] > first[f"acc/stream{j}"] + 0.25
    assert last["sim/accept_length"] > first["sim/accept_length"] + 0.5


# ---- saving ---------------------------------------------------------------------------------------
def test_save_holds_only_lora_and_streams_and_reloads(pair, tmp_path):
    target, model = pair
    model.save_pretrained(str(tmp_path))
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert set(saved) == {"stream_embeddings"} | {f"lora.{k}" for k in model.lora.state_dict()}
    assert sum(t.numel() for t in saved.values()) == sum(model.parameter_counts().values())
    fresh_target = make_target()  # the same original weights, a separate object
    loaded = StreamingModel.from_pretrained(str(tmp_path))
    loaded.attach_target(fresh_target)
    ids = torch.randint(4, VOCAB, (1, 10))
    with torch.no_grad():
        a, b = model(ids), loaded.eval()(ids)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.stream_hidden, b.stream_hidden)


# ---- decoding -------------------------------------------------------------------------------------
def test_stream_tree_is_the_best_nodes_of_the_full_tree():
    torch.manual_seed(0)
    logprobs = torch.randn(3, 30).log_softmax(-1)
    parents, tokens, scores = [], [], []
    frontier = [-1]
    values, ids = logprobs.topk(3, dim=-1)
    for depth in range(3):  # the full 3-ary tree, no expansion limit
        nxt = []
        for parent in frontier:
            for v, t in zip(values[depth].tolist(), ids[depth].tolist()):
                nxt.append(len(tokens))
                parents.append(parent), tokens.append(t), scores.append((scores[parent] if parent >= 0 else 0) + v)
        frontier = nxt
    for budget in (1, 5, 12):
        expected, _ = best_first_tree(parents, tokens, scores, budget)
        got = cartesian_tree(logprobs, 3, budget)
        assert torch.equal(got.tokens, expected.tokens) and torch.equal(got.parents, expected.parents)
    assert cartesian_tree(logprobs, 3, 100).depths().max() == 3


@pytest.fixture(scope="module")
def trained():
    """A streaming model trained on its adapted target's own greedy continuations."""
    target = make_target(seed=4)
    model = make_streaming(target, num_streams=3, num_stream_layers=2, lora_noise=0.02)
    with model.adapted() as adapted:
        prompts = streaming_prompts(12, seed=5)
        seqs = [p + hf_greedy(adapted, p, 30) for p in prompts]
    model, _ = train_streams(target, model, prompts, seqs, steps=150)
    return target, model


def test_greedy_decoding_is_lossless_for_the_adapted_model(trained):
    target, model = trained
    drafter = serve(model, target, top_k=3, total_tokens=10)
    taus, differs = [], 0
    for prompt in streaming_prompts(12, seed=5) + streaming_prompts(12, seed=99):
        with model.adapted() as adapted:
            reference = hf_greedy(adapted, prompt, 30)
        differs += reference != hf_greedy(target, prompt, 30)
        result = generate(target, prompt, drafter, max_new_tokens=30, eos_token_ids=[EOS])
        assert result.tokens == reference, prompt
        taus.append(result.tau)
    assert max(taus) > 1.5  # the streams do draft accepted tokens
    assert differs > 0  # the reference really is the adapted model, not the original


def test_the_shared_target_keeps_its_direct_forward_for_other_methods():
    """Serving a streaming drafter hooks the target's top layers; the hooks act only in the drafter's own
    forward, so plain decoding of that same target still takes the runtime's direct forward (a user's
    hook would turn it off) and still decodes the original model, while the drafter serves the adapted one."""
    from draftsmith.inference.kernels.direct import direct_forward_for

    target = make_target(seed=6)
    model = make_streaming(target, pruning_rank=4)
    drafter = serve(model, target, top_k=3, total_tokens=10, prune=0.05)  # stream and pruning hooks both
    hooked = target.model.layers[-1]
    assert hooked._forward_hooks and hooked._forward_pre_hooks
    assert direct_forward_for(target) is not None
    prompt = streaming_prompts(1, seed=7)[0]
    plain = generate(target, prompt, None, max_new_tokens=20, eos_token_ids=[EOS])
    assert plain.tokens == hf_greedy(target, prompt, 20)
    with model.adapted() as adapted:
        reference = hf_greedy(adapted, prompt, 20)
    assert generate(target, prompt, drafter, max_new_tokens=20, eos_token_ids=[EOS]).tokens == reference
    handle = hooked.register_forward_hook(lambda module, args, output: None)
    assert direct_forward_for(target) is None  # anyone else's hook still turns it off
    handle.remove()


# ---- trainer, recipe, export, loading -------------------------------------------------------------
def test_shipped_recipe_validates():
    from draftsmith.train.recipe import load_train_recipe

    recipe = load_train_recipe(REPO / "recipes/streaming-smollm2.yaml")
    assert recipe.family_name == "streaming" and recipe.drafter["num_streams"] == 4
    assert recipe.loss["kl_weight"] > 0 and recipe.train.lr_scale == {"streams": 20, "lora": 0.1}
    assert recipe.drafter["stream_init_rank"] > 0
    for ns in (2, 4, 8):
        assert load_train_recipe(REPO / "recipes/streaming-smollm2.yaml", [f"drafter.num_stream_layers={ns}"])


def test_train_export_and_decode_through_the_cli(tmp_path, tiny_target_dir):
    from draftsmith.cli import main
    from draftsmith.core.target import load_target
    from draftsmith.inference.methods.table import build_drafter

    prepare_arithmetic_chats(tmp_path / "prep", tiny_target_dir, 10)
    recipe = {
        "target": {"name": str(tiny_target_dir)},
        "output_dir": str(tmp_path / "run"),
        "data": {"prepared": str(tmp_path / "prep"), "eval_samples": 2},
        "drafter": {"family": "streaming", "num_streams": 2, "num_stream_layers": 1, "lora_rank": 4},
        "train": {"lr": 1e-3, "batch_size": 2, "max_steps": 2, "save_every": 2, "log_every": 1},
        "tracking": {"wandb": False},
    }
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    main(["train", str(tmp_path / "recipe.yaml")])
    info = json.loads((tmp_path / "run/run_info.json").read_text())
    main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "export")])
    config = json.loads((tmp_path / "export/config.json").read_text())
    assert config["drafter_family"] == "streaming" and config["num_stream_layers"] == 1
    weights = load_file(str(tmp_path / "export/model.safetensors"))
    assert sum(t.numel() for t in weights.values()) == info["trainable_parameters"]  # nothing of the target
    tiny = load_target(str(tiny_target_dir))
    drafter = build_drafter(f"streaming={tmp_path / 'export'}", tiny)
    prompt = tiny.encode_chat([{"role": "user", "content": "Question 3: what is 3 plus 3?"}])
    result = generate(tiny.model, prompt, drafter, max_new_tokens=16, eos_token_ids=tiny.eos_token_ids)
    with drafter.reference_model() as adapted:
        reference = adapted.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=16, eos_token_id=tiny.eos_token_ids, pad_token_id=0
        )[0, len(prompt) :].tolist()
    assert result.tokens == reference
    # bench judges streaming against the adapted model it serves, and reports its drift from the target
    from draftsmith.inference.measure.bench import Question, run_bench

    results = run_bench(
        tiny,
        [Question("q", "writing", ["Question 3: what is 3 plus 3?"])],
        ["streaming=" + str(tmp_path / "export")],
        16,
    )
    streaming = results["methods"][f"streaming={tmp_path / 'export'}"]["overall"]
    assert streaming["identical"] == streaming["total"] == 1
    assert 0.0 <= streaming["agreement_with_target"] <= 1.0 and streaming["reference"] == "served model"
