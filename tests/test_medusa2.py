"""Medusa-2: heads trained jointly with a LoRA on a tiny random Llama. The loss's self-distillation KL and
head terms, the trainer (its parameter groups), export in peft format and its round trip, and
lossless decoding with respect to the adapted model it serves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from conftest import tiny_llama
from draftsmith.drafters.base import FrozenTarget
from draftsmith.drafters.medusa import resolve_tree
from draftsmith.drafters.medusa2 import Medusa2ConfigError, Medusa2Model
from draftsmith.drafters.registry import get_family
from draftsmith.inference.backends import Backends
from draftsmith.inference.runtime import generate
from draftsmith.train.batch import TrainBatch
from draftsmith.train.losses.medusa import medusa_loss
from draftsmith.train.losses.medusa2 import medusa2_loss
from helpers import hf_greedy, padded, prepare_arithmetic_chats, serve
from helpers import random_prompts as _random_prompts

REPO = Path(__file__).resolve().parents[1]
VOCAB = 97
EOS = 2


def random_prompts(n, seed):
    return _random_prompts(n, seed, VOCAB)


def build(target, lora_noise: float = 0.0, seed: int = 1, **options) -> Medusa2Model:
    """A Medusa-2 model attached to ``target``; ``lora_noise`` > 0 makes the adapter non-zero."""
    options = {"num_heads": 3, "lora_rank": 4, "lora_alpha": 8, **options}
    torch.manual_seed(seed)
    target.requires_grad_(False)  # as the trainer leaves it
    model = get_family("medusa2").build(target.config, options)
    model.init_from_target(FrozenTarget.from_model(target))
    with torch.no_grad():
        for pair in model.lora.values():
            pair.B.weight.normal_(std=lora_noise)
    model.attach_target(target)
    return model


def sequences_batch(target, n: int = 6, new_tokens: int = 16, seed: int = 0) -> TrainBatch:
    """The original target's own greedy continuations (self-distilled data); no features needed."""
    ids, attention = padded([p + hf_greedy(target, p, new_tokens) for p in random_prompts(n, seed)])
    return TrainBatch(ids, attention.float(), attention)


# ---- the loss -------------------------------------------------------------------------------------
def test_kl_is_zero_for_a_zero_lora_and_positive_after_a_perturbation():
    target = tiny_llama(VOCAB)
    batch, frozen = sequences_batch(target), FrozenTarget.from_model(target)
    model = build(target)  # peft's initialisation: B = 0, the adapted model is the original
    with torch.no_grad():
        out = medusa2_loss(model, batch, frozen)
    assert out.metrics["loss/kl"] == 0.0 and out.metrics["agree/original"] == 1.0
    with torch.no_grad():
        for pair in model.lora.values():
            pair.B.weight.normal_(std=0.05)
        out = medusa2_loss(model, batch, frozen)
        assert out.metrics["loss/kl"] > 1e-4
        assert out.loss.item() == pytest.approx(out.metrics["loss/kl"] + 0.2 * out.metrics["loss/heads"], rel=1e-5)
        forward = model(batch.input_ids, attention_mask=batch.attention_mask)
        # the teacher is the same target with the adapters off, and the target stays the original outside
        original = model.next_token_logits(forward.original_features)
        assert torch.equal(original, target(batch.input_ids, attention_mask=batch.attention_mask).logits)
        with model.adapted() as adapted:
            assert torch.equal(forward.logits, adapted(batch.input_ids, attention_mask=batch.attention_mask).logits)
    assert not torch.allclose(forward.logits, original, atol=1e-3)


@pytest.mark.parametrize("chunk_rows", [1, 5])
def test_the_kl_made_in_chunks_gives_the_unchunked_loss_and_gradients(chunk_rows):
    """The adapted and original full-vocabulary logits are made a few rows at a time (checkpointed):
    the loss, its metrics and every gradient are those of all rows at once."""
    target = tiny_llama(VOCAB)
    batch, frozen = sequences_batch(target, n=3, new_tokens=8), FrozenTarget.from_model(target)

    def run(rows: int):
        model = build(target, lora_noise=0.05)
        out = medusa2_loss(model, batch, frozen, logit_chunk_rows=rows)
        out.loss.backward()
        return out, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    (reference, reference_grads), (chunked, grads) = run(0), run(chunk_rows)
    assert reference.metrics["loss/kl"] > 1e-4
    assert float(chunked.loss.detach()) == pytest.approx(float(reference.loss.detach()), rel=1e-6)
    assert chunked.metrics == pytest.approx(reference.metrics, rel=1e-5)  # a KL of small sums: float order
    assert grads.keys() == reference_grads.keys() and any(".lora" in name or "lora" in name for name in grads)
    for name, grad in reference_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_heads_term_is_medusa1s_loss_on_the_adapted_features():
    target = tiny_llama(VOCAB)
    batch, frozen = sequences_batch(target), FrozenTarget.from_model(target)
    model = build(target, lora_noise=0.05)
    with torch.no_grad():
        out = medusa2_loss(model, batch, frozen, soft_labels=True)
        features = model(batch.input_ids, attention_mask=batch.attention_mask, original=False).features
        batch.hidden_states = features
        medusa1 = medusa_loss(model.heads, batch, frozen, soft_labels=True)
    assert out.metrics["loss/heads"] == pytest.approx(medusa1.loss.item(), rel=1e-5)
    assert all(out.metrics[f"acc/head{k}"] == medusa1.metrics[f"acc/head{k}"] for k in (1, 2, 3))


def test_gradients_reach_heads_and_lora_only_and_the_heads_train_the_lora():
    target = tiny_llama(VOCAB)
    batch, frozen = sequences_batch(target, n=3, new_tokens=8), FrozenTarget.from_model(target)
    model = build(target, lora_noise=0.05)
    medusa2_loss(model, batch, frozen).loss.backward()
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name
    assert all(p.grad is None for name, p in target.named_parameters() if ".lora_" not in name)
    model.zero_grad()
    medusa2_loss(model, batch, frozen, kl_weight=0.0).loss.backward()  # joint training: CE reaches the LoRA
    assert all(p.grad.abs().sum() > 0 for p in model.lora.parameters())


def test_options_and_target_errors():
    target = tiny_llama(VOCAB)
    with pytest.raises(Medusa2ConfigError, match="lora_rank must be >= 1"):
        get_family("medusa2").build(target.config, {"lora_rank": 0})
    with pytest.raises(Medusa2ConfigError, match="lora_target_modules"):
        get_family("medusa2").build(target.config, {"lora_target_modules": ["qproj"]})
    with pytest.raises(Medusa2ConfigError, match="lora_layers"):
        get_family("medusa2").build(target.config, {"lora_layers": [2]})
    model = get_family("medusa2").build(target.config, {"lora_rank": 4})
    other = tiny_llama(VOCAB)
    other.config.hidden_size = 32  # only the config matters for the check
    with pytest.raises(Medusa2ConfigError, match="hidden_size"):
        model.attach_target(other)


# ---- decoding -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained():
    """Heads and LoRA trained together on the original target's greedy continuations."""
    target = tiny_llama(VOCAB, seed=2)
    model = build(target, lora_noise=0.03, num_heads=4)
    batch, frozen = sequences_batch(target, n=12, new_tokens=30, seed=5), FrozenTarget.from_model(target)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    model.train()
    for _ in range(80):
        out = medusa2_loss(model, batch, frozen)
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
    return target, model.eval()


def test_greedy_decoding_is_lossless_for_the_adapted_model(trained):
    target, model = trained
    differs, taus = 0, []
    backends = Backends()
    for tree in ("medusa-16", "dynamic"):
        drafter = serve(model, target, tree=tree, total_tokens=10)
        for prompt in random_prompts(6, seed=5) + random_prompts(6, seed=99):
            with drafter.reference_model() as served:
                reference = hf_greedy(served, prompt, 30)
            differs += reference != hf_greedy(target, prompt, 30)
            result = generate(target, prompt, drafter, max_new_tokens=30, eos_token_ids=[EOS], backends=backends)
            assert result.tokens == reference, (tree, prompt)
            taus.append(result.tau)
        # the merged copy took the direct forward: its screened greedy head (direct forwards only) ran
        assert backends.kernels(drafter.served_model()).greedy_head().rows > 0
    assert max(taus) > 1.5  # the heads do draft accepted tokens
    assert differs > 0  # the reference really is the adapted model, not the original


def test_the_served_copy_follows_a_changed_adapter(trained):
    target, model = trained
    drafter = serve(model, target)
    first = drafter.served_model()
    assert drafter.served_model() is first  # made once while nothing changes
    pair = next(iter(model.lora.values()))
    saved = pair.B.weight.detach().clone()
    try:
        with torch.no_grad():
            pair.B.weight.mul_(3.0)  # in place, as an optimizer step
        second = drafter.served_model()
        assert second is not first
        prompt = random_prompts(1, seed=8)[0]
        with drafter.reference_model() as served:
            assert served is second
            reference = hf_greedy(served, prompt, 24)
        assert generate(target, prompt, drafter, max_new_tokens=24, eos_token_ids=[EOS]).tokens == reference
    finally:
        with torch.no_grad():
            pair.B.weight.copy_(saved)


def test_a_target_dispatched_by_accelerate_is_served_through_peft():
    """accelerate's hooks patch each module's own forward, so no copy can stand for such a target: the
    runtime then verifies through peft's wrapped linears, still losslessly."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    target = tiny_llama(VOCAB, seed=4)
    model = build(target, lora_noise=0.05).eval()
    add_hook_to_module(target.model.layers[0], ModelHook())
    drafter = serve(model, target)
    assert drafter.served_model() is None and drafter.verifier_model() is not None
    for prompt in random_prompts(3, seed=6):
        with drafter.reference_model() as adapted:
            reference = hf_greedy(adapted, prompt, 20)
        assert generate(target, prompt, drafter, max_new_tokens=20, eos_token_ids=[EOS]).tokens == reference


# ---- trainer, recipe, export, loading -------------------------------------------------------------
def tiny_recipe(root: Path, target_dir: Path, prepared: Path) -> Path:
    """The shipped Medusa-2 recipe's shape, sized for the tiny target."""
    tree = yaml.safe_load((REPO / "recipes" / "medusa2-smollm2.yaml").read_text())
    tree["target"] = {"name": str(target_dir)}
    tree["output_dir"] = str(root / "run")
    tree["data"] = {"prepared": str(prepared), "eval_samples": 2}
    tree["drafter"].update(num_heads=3, draft_vocab_size=64, tree="medusa-8", lora_rank=4, lora_alpha=8)
    tree["train"].update(lr=1e-3, scheduler="constant", warmup_steps=0, batch_size=2, save_every=2, log_every=1)
    tree["tracking"] = {"wandb": False}
    root.mkdir(parents=True, exist_ok=True)
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


@pytest.fixture(scope="module")
def medusa2_run(tmp_path_factory, tiny_target_dir):
    """Three trainer steps, exported (exact resume is the conformance suite's, for every family)."""
    from draftsmith.cli import main

    root = tmp_path_factory.mktemp("medusa2-run")
    prepare_arithmetic_chats(root / "prepared", tiny_target_dir, 10)
    straight = tiny_recipe(root / "a", tiny_target_dir, root / "prepared")
    main(["train", str(straight), "train.max_steps=3"])
    main(["export", str(root / "a/run"), "--out", str(root / "export")])
    return root


def test_a_run_trains_heads_and_lora_at_their_scaled_rates(medusa2_run):
    info = json.loads((medusa2_run / "a/run/run_info.json").read_text())
    assert info["family"] == "medusa2" and info["features"] == "online"
    a = load_file(str(medusa2_run / "a/run/checkpoints/step-3/drafter/model.safetensors"))
    assert any(k.startswith("heads.medusa_head.") for k in a) and any(k.startswith("lora.layers_") for k in a)
    assert sum(t.numel() for k, t in a.items() if t.is_floating_point()) == info["trainable_parameters"]
    records = [json.loads(line) for line in (medusa2_run / "a/run/metrics.jsonl").read_text().splitlines()]
    rates = [(r["lr/heads"], r["lr/lora"]) for r in records if "loss" in r]
    assert len(rates) == 3 and all(lora == pytest.approx(0.1 * heads) and heads == 1e-3 for heads, lora in rates)


def test_a_checkpoint_with_other_optimizer_groups_is_refused_in_one_line(medusa2_run, tiny_target_dir, monkeypatch):
    """A run written before the groups existed (one group for heads and LoRA) cannot be resumed."""
    from draftsmith.train import trainer as trainer_module
    from draftsmith.train.recipe import load_train_recipe

    def one_group(model, train):
        params = [p for p in model.parameters() if p.requires_grad]
        return [{"params": params, "lr": train.lr, "name": "heads", "lr_scale": 1.0}]

    path = tiny_recipe(medusa2_run / "old", tiny_target_dir, medusa2_run / "prepared")
    with monkeypatch.context() as patch:
        patch.setattr(trainer_module, "optimizer_groups", one_group)
        trainer_module.train(load_train_recipe(path, ["train.max_steps=2", "data.eval_samples=0"]))
    with pytest.raises(
        trainer_module.TrainingError, match=r"other parameter groups than this drafter's \(heads, lora\)"
    ):
        trainer_module.Trainer(load_train_recipe(path, ["train.max_steps=3", "data.eval_samples=0"]), resume=True)


def test_parameter_groups_take_their_scaled_rate_through_the_schedule():
    """The shipped recipe's ``lr_scale.lora: 0.1``: heads then LoRA, every group warmed up and decayed."""
    from draftsmith.train.recipe import TrainSection
    from draftsmith.train.trainer import build_scheduler, optimizer_groups

    model = get_family("medusa2").build(tiny_llama(VOCAB).config, {"num_heads": 2, "lora_rank": 4})
    train = TrainSection(lr=1e-2, lr_scale={"lora": 0.1}, scheduler="linear", warmup_steps=2)
    groups = optimizer_groups(model, train)
    assert [g["name"] for g in groups] == ["heads", "lora"]
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    optimizer = torch.optim.AdamW(groups, lr=train.lr)
    scheduler = build_scheduler(optimizer, train, total_steps=6)
    seen = []
    for _ in range(6):
        heads, lora = (group["lr"] for group in optimizer.param_groups)
        assert lora == pytest.approx(0.1 * heads, abs=1e-15)
        seen.append(heads)
        optimizer.step()
        scheduler.step()
    assert seen[0] == 0.0 and seen[2] == pytest.approx(1e-2) and seen[5] < seen[2]


def test_export_holds_heads_and_a_peft_adapter_and_round_trips(medusa2_run, tiny_target_dir):
    from peft import PeftModel

    from draftsmith.core.target import load_target

    export = medusa2_run / "export"
    config = json.loads((export / "config.json").read_text())
    assert config["drafter_family"] == "medusa2" and config["target_identity"]["config_hash"]
    assert all(k.startswith("medusa_head.") or k == "draft_vocab" for k in load_file(str(export / "model.safetensors")))
    adapter = json.loads((export / "adapter_config.json").read_text())
    assert adapter["peft_type"] == "LORA" and adapter["r"] == 4
    assert adapter["base_model_name_or_path"] == config["target_identity"]["name"]
    loaded = Medusa2Model.from_pretrained(export)
    trained = Medusa2Model.from_pretrained(medusa2_run / "a/run/checkpoints/step-3/drafter")
    expected = trained.state_dict()
    assert set(loaded.state_dict()) == set(expected)
    assert all(torch.equal(value, expected[key]) for key, value in loaded.state_dict().items())
    # peft itself reads the adapter: its model is the one Medusa-2 serves
    tiny = load_target(str(tiny_target_dir))
    loaded.attach_target(tiny.model)
    ids = torch.tensor([[5, 9, 14, 33, 7, 21]])
    with torch.no_grad(), loaded.adapted() as adapted:
        ours = adapted(ids).logits
    theirs = PeftModel.from_pretrained(load_target(str(tiny_target_dir)).model, str(export))(ids).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


def test_the_served_model_is_peft_merge_and_unload_sharing_every_unadapted_weight(medusa2_run, tiny_target_dir):
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    from draftsmith.core.target import load_target
    from draftsmith.inference.methods.table import build_drafter

    export = medusa2_run / "export"
    tiny = load_target(str(tiny_target_dir))
    ids = torch.tensor([[5, 9, 14, 33, 7, 21]])
    with torch.no_grad():
        original = tiny.model(ids).logits
    drafter = build_drafter(f"medusa={export}", tiny)
    served = drafter.served_model()
    assert type(served) is type(tiny.model) and not any(isinstance(m, LoraLayer) for m in served.modules())
    theirs = PeftModel.from_pretrained(load_target(str(tiny_target_dir)).model, str(export)).merge_and_unload()
    ours = served.state_dict()
    assert set(ours) == set(theirs.state_dict())
    assert all(torch.equal(ours[key], value) for key, value in theirs.state_dict().items())
    # only the adapted projections are new; the shared target is still the original model
    layers, modules = range(tiny.model.config.num_hidden_layers), ("q_proj", "k_proj", "v_proj", "o_proj")
    adapted = {f"model.layers.{i}.self_attn.{m}.weight" for i in layers for m in modules}
    assert {key for key, value in served.named_parameters() if key in adapted} == adapted
    target_weights = {id(p) for p in tiny.model.parameters()}
    assert all((id(p) in target_weights) != (key in adapted) for key, p in served.named_parameters())
    with torch.no_grad():
        assert torch.equal(tiny.model(ids).logits, original)


def test_calibrate_scores_the_heads_on_the_model_medusa2_serves(tiny_target_dir, tmp_path, capsys):
    """The heads read the merged model's features when serving, so calibrate measures them there (and
    against that model's greedy tokens), from a prepared dataset or a feature cache of the original."""
    from draftsmith.cli import main
    from draftsmith.core.target import Target, load_target
    from draftsmith.drafters.base import TreeOptions
    from draftsmith.drafters.io import export_drafter
    from draftsmith.train.medusa_calibrate import calibrate, iter_samples, measure_head_accuracy

    prepared, cache = tmp_path / "prepared", tmp_path / "features"
    prepare_arithmetic_chats(prepared, tiny_target_dir, 10)
    main(["data", "cache-features", str(prepared), "--out", str(cache), "--target", str(tiny_target_dir)])
    target = load_target(str(tiny_target_dir))
    model = build(target.model, lora_noise=0.05).eval()
    export = export_drafter(model, target.identity.to_dict(), tmp_path / "medusa2")
    merged = model.runtime_drafter(target.model, TreeOptions()).served_model()

    def accuracy_on(scoring_model):
        scorer = Target(scoring_model, target.tokenizer, target.identity)
        return measure_head_accuracy(model.heads, scorer, iter_samples(prepared, scorer, 4), 10)["accuracy"]

    on_merged = accuracy_on(merged)
    assert on_merged != accuracy_on(target.model)  # the adapter changes what the heads are scored on
    for data in (prepared, cache):
        out = tmp_path / f"tree-{data.name}.json"
        assert calibrate(export, data, 4, str(tiny_target_dir), samples=4, out=out)["head_accuracy"] == on_merged
    main(
        [
            "medusa",
            "calibrate",
            str(export),
            "--data",
            str(prepared),
            "--nodes",
            "4",
            "--samples",
            "4",
            "--target",
            str(tiny_target_dir),
        ]
    )
    assert "4-node tree" in capsys.readouterr().out
    assert len(json.loads((export / "config.json").read_text())["tree"]) == 4


def test_an_adapter_that_does_not_match_the_config_is_refused(medusa2_run, tmp_path):
    import shutil

    from draftsmith.drafters.io import DrafterCheckpointError

    copy = tmp_path / "export"
    shutil.copytree(medusa2_run / "export", copy)
    adapter = json.loads((copy / "adapter_config.json").read_text())
    (copy / "adapter_config.json").write_text(json.dumps({**adapter, "lora_alpha": 2 * adapter["lora_alpha"]}))
    with pytest.raises(DrafterCheckpointError, match="adapter_config.json holds"):
        Medusa2Model.from_pretrained(copy)


def test_exported_drafter_serves_the_adapted_model_and_bench_reports_agreement(medusa2_run, tiny_target_dir):
    from draftsmith.core.target import load_target
    from draftsmith.inference.measure.bench import Question, run_bench
    from draftsmith.inference.methods.table import build_drafter

    export = medusa2_run / "export"
    tiny = load_target(str(tiny_target_dir))
    drafter = build_drafter(f"medusa={export}", tiny)
    assert drafter.name == "medusa2" and drafter.static.paths == tuple(resolve_tree("medusa-8", 3))
    prompt = tiny.encode_chat([{"role": "user", "content": "Question 3: what is 3 plus 3?"}])
    result = generate(tiny.model, prompt, drafter, max_new_tokens=16, eos_token_ids=tiny.eos_token_ids)
    with drafter.reference_model() as adapted:
        reference = hf_greedy(adapted, prompt, 16, tiny.eos_token_ids)
    assert result.tokens == reference
    assert build_drafter(f"medusa={export}:tree=dynamic", tiny).static is None
    method = f"medusa={export}"
    results = run_bench(tiny, [Question("q", "writing", ["Question 3: what is 3 plus 3?"])], [method], 16)
    summary = results["methods"][method]["overall"]
    assert summary["identical"] == summary["total"] == 1 and summary["reference"] == "served model"
    assert 0.0 <= summary["agreement_with_target"] <= 1.0


def test_loading_for_another_target_is_refused(medusa2_run, other_target_dir):
    from draftsmith.core.target import TargetError, load_target
    from draftsmith.drafters.io import DrafterCheckpointError
    from draftsmith.inference.methods.table import build_drafter

    with pytest.raises(TargetError, match="trained for"):
        build_drafter(f"medusa={medusa2_run / 'export'}", load_target(str(other_target_dir)))
    with pytest.raises(DrafterCheckpointError, match="not 'eagle'; use --method medusa="):
        build_drafter(f"eagle={medusa2_run / 'export'}", load_target(str(other_target_dir)))


def test_shipped_recipe_validates():
    from draftsmith.train.recipe import load_train_recipe

    recipe = load_train_recipe(REPO / "recipes/medusa2-smollm2.yaml")
    assert recipe.family_name == "medusa2" and recipe.data.features is None
    assert recipe.loss == {
        "kl_weight": 1.0,
        "head_weight": 0.2,
        "decay": 0.8,
        "soft_labels": False,
        "logit_chunk_rows": 1024,
    }
    assert load_train_recipe(REPO / "recipes/medusa2-smollm2.yaml", ["drafter.lora_rank=8"]).drafter["lora_rank"] == 8


def test_starts_from_a_medusa1_export_as_the_two_stage_recipe_does(medusa2_run, tiny_target_dir, tmp_path, capsys):
    """``train.init_from`` a Medusa-1 export: the heads are Medusa-1's, the LoRA starts at zero."""
    from draftsmith.cli import main

    stage1 = {
        "target": {"name": str(tiny_target_dir)},
        "output_dir": str(tmp_path / "medusa1"),
        "data": {"prepared": str(medusa2_run / "prepared"), "eval_samples": 2},
        "drafter": {"family": "medusa", "num_heads": 3, "draft_vocab_size": 64, "tree": "medusa-8"},
        "train": {"lr": 1e-2, "batch_size": 2, "max_steps": 2, "save_every": 2, "log_every": 1},
        "tracking": {"wandb": False},
    }
    (tmp_path / "medusa1.yaml").write_text(yaml.safe_dump(stage1))
    main(["train", str(tmp_path / "medusa1.yaml")])
    main(["export", str(tmp_path / "medusa1"), "--out", str(tmp_path / "medusa1-export")])
    stage2 = tiny_recipe(tmp_path / "m2", tiny_target_dir, medusa2_run / "prepared")
    main(
        ["train", str(stage2), "train.max_steps=1", "train.lr=1e-12", f"train.init_from={tmp_path / 'medusa1-export'}"]
    )
    started = Medusa2Model.from_pretrained(tmp_path / "m2/run/checkpoints/step-1/drafter")
    heads = load_file(str(tmp_path / "medusa1-export/model.safetensors"))
    for key, value in heads.items():  # one step at lr 1e-12 leaves them as they were
        torch.testing.assert_close(started.heads.state_dict()[key], value, rtol=0, atol=1e-9)
    assert all(pair.B.weight.abs().max() < 1e-9 for pair in started.lora.values())  # fresh LoRA: B = 0

    eagle_export = tmp_path / "an-eagle-export"
    eagle_export.mkdir()
    (eagle_export / "config.json").write_text(json.dumps({"drafter_family": "eagle"}))
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(
            [
                "train",
                str(stage2),
                "train.max_steps=1",
                f"output_dir={tmp_path / 'm2b'}",
                f"train.init_from={eagle_export}",
            ]
        )
    assert "a 'medusa2' run starts from 'medusa2' or 'medusa'" in capsys.readouterr().err
