"""The generic trainer on a tiny random Llama target: loop, checkpoints, exact resume, guards, export,
tracking, and (slow) data parallelism with DeepSpeed ZeRO-2 on two CPU processes."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from draftsmith.cli import main
from draftsmith.core.target import load_target
from draftsmith.data.features import CacheSettings, FeatureCacheError, build_feature_cache
from draftsmith.data.prepared import PreparedDataError, PreparedDataset
from draftsmith.drafters.registry import get_family
from draftsmith.train.checkpoint import MARKER, complete_checkpoints, latest_checkpoint
from draftsmith.train.recipe import load_train_recipe
from draftsmith.train.recipe_loader import RecipeError
from draftsmith.train.trainer import Trainer, train
from helpers import interrupt_at, losses, write_recipe

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture()
def recipe_path(tmp_path, tiny_target_dir, prepared_dir):
    return write_recipe(tmp_path, tiny_target_dir, prepared_dir)


def test_training_logs_finite_losses_and_writes_complete_checkpoints(tmp_path, recipe_path):
    recipe = load_train_recipe(recipe_path, ["train.keep_last=1", "data.eval_samples=3"])
    result = train(recipe)
    run = Path(recipe.output_dir)
    curve = losses(run)
    assert sorted(curve) == [1, 2, 3, 4] and all(torch.isfinite(torch.tensor(list(curve.values()))))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_record = next(r for r in records if "loss" in r)
    assert {"lr", "tokens_per_s", "loss/smooth_l1", "loss/ce", "acc/step1"} <= set(train_record)
    assert "acc/step2" not in train_record  # unrolled steps cost a forward each: evaluation only
    assert any("eval/loss" in r for r in records)  # held-out evaluation at each checkpoint
    evaluated = next(r for r in records if "eval/loss" in r and r["step"] == 4)
    state = json.loads((run / "checkpoints/step-4/trainer_state.json").read_text())
    assert state["eval"] == {k: v for k, v in evaluated.items() if k.startswith("eval/")}  # recorded with it
    assert {"eval/sim/accept_length", "eval/acc/step2"} <= set(state["eval"])
    assert train_record["lr"] == 0.0 and train_record["tokens_per_s"] > 0  # warmup starts at zero
    assert [p.name for p in complete_checkpoints(run)] == ["step-4"]  # keep_last=1
    assert result.checkpoint == run / "checkpoints" / "step-4" and result.step == 4
    info = json.loads((run / "run_info.json").read_text())
    assert info["world_size"] == 1 and info["features"] == "online" and info["eval_samples"] == 3
    assert info["train_samples"] == len(PreparedDataset(Path(recipe.data.prepared))) - 3
    assert yaml.safe_load((run / "recipe.resolved.yaml").read_text())["train"]["keep_last"] == 1


def test_gradients_reach_only_the_drafter_and_data_shapes_the_draft_vocab(tmp_path, recipe_path):
    trainer = Trainer(load_train_recipe(recipe_path, ["drafter.draft_vocab_size=8"]))
    counts = trainer.data.token_counts(len(trainer.target.tokenizer))
    assert int(counts.argmax()) in trainer.model.draft_vocab.tolist()  # fit on supervised training tokens
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    embed = trainer.frozen.embed_tokens.weight.clone()
    trainer.train_step(0)
    trainer.train_step(1)  # step 0 has lr 0 (warmup)
    after = trainer.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert torch.equal(embed, trainer.frozen.embed_tokens.weight)
    assert not any(p.requires_grad for p in trainer.target.model.parameters())
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in after)  # the target is never saved


def tokens_seen(run: Path) -> dict[int, int]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["tokens_seen"] for r in records if "loss" in r}


def test_resume_continues_exactly(tmp_path, tiny_target_dir, prepared_dir, monkeypatch):
    common = ["train.max_steps=6", "train.save_every=2", "train.grad_accum=2"]  # 6 steps = 1.5 epochs of 16
    full = write_recipe(tmp_path / "a", tiny_target_dir, prepared_dir)
    train(load_train_recipe(full, common))
    interrupted = write_recipe(tmp_path / "b", tiny_target_dir, prepared_dir)
    with monkeypatch.context() as patch:
        interrupt_at(patch, 4)  # dies during step 5, after checkpoint step-4
        with pytest.raises(KeyboardInterrupt):
            train(load_train_recipe(interrupted, common))
    run_b = tmp_path / "b" / "run"
    assert latest_checkpoint(run_b).name == "step-4" and max(losses(run_b)) == 4
    train(load_train_recipe(interrupted, common), resume=True)
    curve_a, curve_b = losses(tmp_path / "a" / "run"), losses(run_b)
    assert sorted(curve_b) == [1, 2, 3, 4, 5, 6]
    for step in curve_a:
        assert curve_b[step] == pytest.approx(curve_a[step], rel=1e-6, abs=1e-9), step
    assert tokens_seen(run_b) == tokens_seen(tmp_path / "a" / "run")  # the count resumes with the run
    assert sorted(tokens_seen(run_b)) == [1, 2, 3, 4, 5, 6] and tokens_seen(run_b)[6] > tokens_seen(run_b)[1] > 0
    weights_a = load_file(str(tmp_path / "a/run/checkpoints/step-6/drafter/model.safetensors"))
    weights_b = load_file(str(run_b / "checkpoints/step-6/drafter/model.safetensors"))
    for key in weights_a:
        torch.testing.assert_close(weights_a[key], weights_b[key], rtol=1e-6, atol=1e-7)


def test_an_interrupted_checkpoint_write_never_replaces_the_last_good_one(tmp_path, recipe_path, monkeypatch):
    import draftsmith.train.checkpoint as checkpoint

    recipe = load_train_recipe(recipe_path)
    run = Path(recipe.output_dir)
    calls = {"n": 0}
    original = checkpoint._fsync_tree

    def crash_on_second_write(root):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("disk full")
        original(root)

    monkeypatch.setattr(checkpoint, "_fsync_tree", crash_on_second_write)
    with pytest.raises(OSError, match="disk full"):
        train(recipe)
    assert (run / "checkpoints" / ".tmp-step-4").is_dir()  # the half-written one stays a temp dir
    (run / "checkpoints" / "step-9").mkdir()  # and a directory without the marker is ignored too
    assert latest_checkpoint(run).name == "step-2" and (run / "checkpoints/step-2" / MARKER).is_file()
    monkeypatch.setattr(checkpoint, "_fsync_tree", original)
    result = train(recipe, resume=True)
    assert result.checkpoint.name == "step-4" and not (run / "checkpoints" / ".tmp-step-4").exists()


def test_a_crash_while_keep_last_deletes_a_checkpoint_leaves_no_half_deleted_one(recipe_path, monkeypatch):
    """A kill in the middle of deleting an old checkpoint must not leave a ``step-N`` that keeps its marker but
    lost files: the resumed run's next save reads every complete one for the best, and would stop on it."""
    import draftsmith.train.checkpoint as checkpoint

    class Killed(BaseException):
        pass

    original = shutil.rmtree

    def killed_half_way(path, *args, **kwargs):
        path = Path(path)
        if (path / MARKER).is_file() and (path / "trainer_state.json").is_file():
            (path / "trainer_state.json").unlink()
            raise Killed
        original(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed_half_way)
    with pytest.raises(Killed):  # step 4's save deletes step-2 (keep_last=1) and dies half way
        main(["train", str(recipe_path), "train.max_steps=6", "train.keep_last=1"])
    monkeypatch.setattr(checkpoint.shutil, "rmtree", original)
    run = recipe_path.parent / "run"
    assert [p.name for p in complete_checkpoints(run)] == ["step-4"]
    main(["train", str(recipe_path), "train.max_steps=6", "train.keep_last=1", "--resume"])
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-6"]  # the leftover went too


def test_nan_loss_stops_with_one_line_naming_the_step(tmp_path, recipe_path, monkeypatch, capsys):
    import functools

    from draftsmith.train import losses

    original = losses.LOSSES["feature_distillation_loss"]
    calls = {"n": 0}

    @functools.wraps(original)
    def poisoned(model, batch, frozen, **options):
        out = original(model, batch, frozen, **options)
        calls["n"] += 1
        if calls["n"] == 3:  # the first micro-batch of step 3
            out.loss = out.loss * float("nan")
        return out

    monkeypatch.setitem(losses.LOSSES, "feature_distillation_loss", poisoned)
    with pytest.raises(SystemExit) as info:
        main(["train", str(recipe_path)])
    stderr = capsys.readouterr().err
    err = [line for line in stderr.splitlines() if line.startswith("draftsmith: error")]
    assert info.value.code == 2 and len(err) == 1 and "Traceback" not in stderr
    assert "the loss is nan at step 3" in err[0] and "last checkpoint is intact" in err[0]
    assert latest_checkpoint(tmp_path / "run").name == "step-2"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["drafter.feature_sampler=true", "drafter.featur_sampler=1"], "did you mean 'feature_sampler'"),
        (["drafter.family=medusa9"], "unknown drafter family 'medusa9'"),
        (["loss.ce_wieght=0.1"], "did you mean 'ce_weight'"),
        (["train.batch_size=0"], "train.batch_size must be > 0"),
        (["train.lrr=1"], "did you mean 'lr'"),
        (["train.lr_scale.lora=0.1"], r"a fspad drafter has no parameter group 'lora' \(its groups: drafter\)"),
        (["train.lr_scale.drafter=0"], "train.lr_scale.drafter must be a number > 0, got 0"),
        (["train.lr_scale.drafter=fast"], "train.lr_scale.drafter must be float, got 'fast'"),
    ],
)
def test_recipe_errors_before_training(recipe_path, overrides, message):
    with pytest.raises(RecipeError, match=message):
        load_train_recipe(recipe_path, overrides)


def test_data_errors_name_the_fix(tmp_path, tiny_target_dir, other_target_dir, prepared_dir):
    missing = write_recipe(tmp_path, tiny_target_dir, tmp_path / "nope")
    with pytest.raises(PreparedDataError, match=r"does not exist; make it with `draftsmith data prepare"):
        Trainer(load_train_recipe(missing))
    other = write_recipe(tmp_path, other_target_dir, prepared_dir)
    with pytest.raises(PreparedDataError, match="prepared for another target"):
        Trainer(load_train_recipe(other))
    too_big = write_recipe(tmp_path, tiny_target_dir, prepared_dir, train={"batch_size": 64})
    with pytest.raises(PreparedDataError, match="fewer than one global batch"):
        Trainer(load_train_recipe(too_big))


def test_resume_refuses_another_recipe_and_fresh_runs_refuse_old_checkpoints(recipe_path, capsys):
    train(load_train_recipe(recipe_path, ["train.max_steps=2"]))
    with pytest.raises(SystemExit):
        main(["train", str(recipe_path), "train.max_steps=2"])
    assert "already holds checkpoints" in capsys.readouterr().err
    with pytest.raises(RecipeError, match=r"train.lr was 0.001, now 0.002"):
        Trainer(load_train_recipe(recipe_path, ["train.lr=2e-3"]), resume=True)
    result = train(load_train_recipe(recipe_path, ["train.max_steps=3"]), resume=True)  # max_steps may grow
    assert result.checkpoint.name == "step-3" and sorted(losses(result.output_dir)) == [1, 2, 3]


def test_a_run_saved_before_a_recipe_key_existed_resumes_at_its_default(recipe_path):
    result = train(load_train_recipe(recipe_path, ["train.max_steps=2"]))
    saved = result.output_dir / "recipe.resolved.yaml"
    tree = yaml.safe_load(saved.read_text())
    del tree["data"]["group_by_length"]  # as an older draftsmith wrote it
    saved.write_text(yaml.safe_dump(tree))
    with pytest.raises(RecipeError, match=r"data.group_by_length was None, now True"):
        Trainer(load_train_recipe(recipe_path, ["data.group_by_length=true"]), resume=True)
    result = train(load_train_recipe(recipe_path, ["train.max_steps=3"]), resume=True)
    assert result.checkpoint.name == "step-3"


def test_max_minutes_stops_the_sitting_with_a_checkpoint_and_resume_goes_on(recipe_path, capsys):
    result = train(load_train_recipe(recipe_path, ["train.max_minutes=1e-9", "train.save_every=100"]))
    assert result.step == 1 and result.checkpoint.name == "step-1"
    shown = capsys.readouterr()
    assert "stopped after train.max_minutes=1e-09 at step 1 of 4" in shown.out + shown.err
    result = train(load_train_recipe(recipe_path, ["train.save_every=100"]), resume=True)
    assert result.step == 4 and result.checkpoint.name == "step-4" and sorted(losses(result.output_dir)) == [1, 2, 3, 4]


class _Lengths:
    """A stand-in prepared dataset: only the sample lengths matter to the sample order."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def sample_length(self, index: int) -> int:
        return self.lengths[index]


def test_length_grouping_pads_less_and_depends_only_on_seed_and_epoch():
    from draftsmith.train.loader import TrainData

    lengths = torch.randint(20, 2000, (400,), generator=torch.Generator().manual_seed(0)).tolist()

    def padded_tokens(order: list[int], size: int = 4) -> int:
        return sum(size * max(lengths[i] for i in order[s : s + size]) for s in range(0, len(order), size))

    plain = TrainData(_Lengths(lengths), eval_samples=8)
    grouped = TrainData(_Lengths(lengths), eval_samples=8, length_group=4)
    order = grouped.epoch_order(seed=3, epoch=0)
    assert sorted(order) == sorted(plain.train_indices) == sorted(plain.epoch_order(seed=3, epoch=0))
    real = sum(lengths[i] for i in order)
    assert padded_tokens(order) < 1.1 * real < 0.75 * padded_tokens(plain.epoch_order(seed=3, epoch=0))
    again = TrainData(_Lengths(lengths), eval_samples=8, length_group=4)
    assert again.epoch_order(seed=3, epoch=0) == order and again.epoch_order(seed=3, epoch=1) != order


def test_train_samples_keeps_nested_subsets_and_the_same_held_out_samples():
    from draftsmith.train.loader import TrainData

    lengths = list(range(10, 410))
    whole = TrainData(_Lengths(lengths), eval_samples=8)
    small, large = (TrainData(_Lengths(lengths), eval_samples=8, train_samples=n) for n in (50, 200))
    assert small.eval_indices == large.eval_indices == whole.eval_indices
    assert len(small.train_indices) == 50 and set(small.train_indices) < set(large.train_indices)
    assert set(large.train_indices) < set(whole.train_indices) and large.train_indices != whole.train_indices[:200]
    with pytest.raises(PreparedDataError, match="data.train_samples=393: choose from 1 to the 392 training samples"):
        TrainData(_Lengths(lengths), eval_samples=8, train_samples=393)


def test_held_out_samples_with_a_copy_in_training_are_reported(tmp_path, tiny_target_dir, recipe_path, capsys):
    from conftest import sharegpt, write_jsonl

    records = [sharegpt(("human", f"What is {i} times 3?"), ("gpt", f"It is {3 * i}."), id=f"r{i}") for i in range(6)]
    copies = [{**record, "id": record["id"] + "-copy"} for record in records]
    data = write_jsonl(tmp_path / "twice.jsonl", records + copies)
    prepared = tmp_path / "twice"
    main(["data", "prepare", str(data), "--out", str(prepared), "--target", str(tiny_target_dir), "--keep-duplicates"])
    capsys.readouterr()
    (tmp_path / "copies").mkdir()
    recipe = write_recipe(tmp_path / "copies", tiny_target_dir, prepared)
    Trainer(load_train_recipe(recipe, ["data.eval_samples=3"]))
    warning = capsys.readouterr().err
    assert "of the 3 held-out samples have an exact copy among the training samples" in warning
    assert "draftsmith data prepare" in warning
    Trainer(load_train_recipe(recipe_path, ["data.eval_samples=3"]))  # distinct samples: nothing to report
    assert "held-out samples have an exact copy" not in capsys.readouterr().err


def test_a_data_subset_alone_shapes_the_draft_vocabulary(recipe_path):
    trainer = Trainer(load_train_recipe(recipe_path, ["data.train_samples=3", "data.eval_samples=2"]))
    vocab = len(trainer.target.tokenizer)
    prepared = trainer.data.prepared
    expected = sum(
        torch.bincount(prepared[i].input_ids[prepared[i].loss_mask.bool()].long(), minlength=vocab)
        for i in trainer.data.train_indices
    )
    assert len(trainer.data.train_indices) == 3 and torch.equal(trainer.data.token_counts(vocab), expected)


def test_offline_features_match_online_training(tmp_path, tiny_target_dir, prepared_dir, other_target_dir):
    cache = tmp_path / "features"
    build_feature_cache(
        PreparedDataset(prepared_dir),
        load_target(str(tiny_target_dir)),
        cache,
        CacheSettings(dtype="fp32", shard_tokens=200),
    )
    no_noise = ["loss.feature_noise=0", "train.max_steps=2"]
    online = write_recipe(tmp_path / "on", tiny_target_dir, prepared_dir)
    offline = write_recipe(tmp_path / "off", tiny_target_dir, prepared_dir, data={"features": str(cache)})
    train(load_train_recipe(online, no_noise))
    result = train(load_train_recipe(offline, no_noise))
    assert json.loads((result.output_dir / "run_info.json").read_text())["features"] == "offline"
    # shard-wise shuffling reads other samples than the online order, so compare on the same batch:
    trainer = Trainer(load_train_recipe(offline, [*no_noise, "output_dir=" + str(tmp_path / "x")]))
    indices = trainer.data.global_batch(0, trainer.plan, 0)
    cached = trainer.data.collate(indices)
    trainer.data.cache = None  # the same samples, features computed by the target inside the step
    computed = trainer._batch(indices)
    assert torch.equal(cached.input_ids, computed.input_ids)
    real = cached.attention_mask.bool()  # padded positions carry no feature in the cache
    torch.testing.assert_close(cached.hidden_states[real], computed.hidden_states[real], rtol=1e-4, atol=1e-5)
    wrong = write_recipe(tmp_path / "w", other_target_dir, prepared_dir, data={"features": str(cache)})
    with pytest.raises((FeatureCacheError, PreparedDataError), match="another target"):
        Trainer(load_train_recipe(wrong))


def test_a_cache_in_a_runs_order_serves_it_before_it_is_finished(tmp_path, tiny_target_dir, prepared_dir):
    dataset, target = PreparedDataset(prepared_dir), load_target(str(tiny_target_dir))
    cache = tmp_path / "features"

    def cache_features(**order):
        manifest = build_feature_cache(dataset, target, cache, CacheSettings(dtype="fp32", shard_tokens=60, **order))
        return manifest, sum(len(shard["sample_ids"]) for shard in manifest["shards"])

    partial, held = cache_features(eval_samples=2, train_samples=3)
    assert not partial["complete"] and 5 <= held < len(dataset)
    recipe = write_recipe(tmp_path / "off", tiny_target_dir, prepared_dir, data={"features": str(cache)})
    subset = ["data.eval_samples=2", "data.train_samples=3", "train.max_steps=1", "train.batch_size=1"]
    trainer = Trainer(load_train_recipe(recipe, subset))
    for index in trainer.data.eval_indices + trainer.data.train_indices:
        assert torch.equal(trainer.data.sample(index)[0], dataset[index].input_ids)  # each sample its own features
    with pytest.raises(FeatureCacheError, match=r"lacks the features of \d+ of the 16 samples .*--eval-samples 2` and"):
        Trainer(load_train_recipe(recipe, ["data.eval_samples=2"]))
    with pytest.raises(FeatureCacheError, match="in the order of data.eval_samples=2: train with that"):
        Trainer(load_train_recipe(recipe, ["data.eval_samples=3", "data.train_samples=3"]))
    with pytest.raises(FeatureCacheError, match="another sample order"):
        build_feature_cache(dataset, target, cache, CacheSettings(dtype="fp32", shard_tokens=60))
    whole, held = cache_features(eval_samples=2)  # extends the same cache to every sample
    assert whole["complete"] and held == len(dataset) and whole["shards"][0] == partial["shards"][0]
    run = train(load_train_recipe(recipe, subset)).output_dir
    assert json.loads((run / "run_info.json").read_text())["features"] == "offline"


def test_export_writes_a_self_describing_drafter(tmp_path, recipe_path, capsys):
    from draftsmith.drafters.eagle import EagleModel

    recipe = load_train_recipe(recipe_path)
    train(recipe)
    out = tmp_path / "exported"
    main(["export", recipe.output_dir, "--out", str(out)])
    assert f"--method fspad={out}" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["drafter_family"] == "fspad" and config["feature_sampler"] and config["partial_alignment"]
    info = json.loads((Path(recipe.output_dir) / "run_info.json").read_text())
    assert config["target_identity"] == info["target_identity"]
    model = EagleModel.from_pretrained(str(out))
    saved = load_file(str(Path(recipe.output_dir) / "checkpoints/step-4/drafter/model.safetensors"))
    for key, value in model.state_dict().items():
        assert torch.equal(value, saved[key])
    with pytest.raises(SystemExit):
        main(["export", recipe.output_dir, "--out", str(out)])
    assert "--overwrite" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["export", recipe.output_dir, "--out", str(tmp_path / "o2"), "--checkpoint", "step-3"])
    assert "complete ones: step-2, step-4" in capsys.readouterr().err
    main(["export", recipe.output_dir, "--out", str(tmp_path / "o3"), "--checkpoint", "step-2"])
    with pytest.raises(SystemExit):  # FSPAD has no place in vLLM's EAGLE layout: one line, not a traceback
        main(["export", recipe.output_dir, "--out", str(tmp_path / "o4"), "--format", "vllm"])
    assert "FSPAD has no serving-engine layout" in capsys.readouterr().err and not (tmp_path / "o4").exists()


def test_the_best_checkpoint_survives_keep_last_and_export_best_takes_it(tmp_path, recipe_path, monkeypatch, capsys):
    from draftsmith.train.checkpoint import BEST_METRIC

    original, scores = Trainer.evaluate, iter([2.0, 3.0, 1.0])  # steps 2, 4, 6: step 4 is the best

    def evaluate(self):
        return {**original(self), BEST_METRIC: next(scores)}

    monkeypatch.setattr(Trainer, "evaluate", evaluate)
    run = tmp_path / "run"
    main(["train", str(recipe_path), "train.max_steps=6", "train.keep_last=1", "data.eval_samples=2"])
    assert [p.name for p in complete_checkpoints(run)] == ["step-4", "step-6"]  # step-2 went, the best stayed
    main(["export", str(run), "--out", str(tmp_path / "best"), "--best"])
    main(["export", str(run), "--out", str(tmp_path / "last")])
    best, last = (
        load_file(str(tmp_path / "best/model.safetensors")),
        load_file(str(tmp_path / "last/model.safetensors")),
    )
    step4 = load_file(str(run / "checkpoints/step-4/drafter/model.safetensors"))
    assert all(torch.equal(best[k], step4[k]) for k in step4) and not all(torch.equal(best[k], last[k]) for k in last)
    with pytest.raises(SystemExit):
        main(["export", str(run), "--out", str(tmp_path / "x"), "--best", "--checkpoint", "step-6"])
    assert "give --checkpoint or --best, not both" in capsys.readouterr().err


def test_export_best_needs_evaluated_checkpoints(tmp_path, recipe_path, capsys):
    main(["train", str(recipe_path), "train.max_steps=2"])  # no eval samples: nothing ranks the checkpoints
    with pytest.raises(SystemExit):
        main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "x"), "--best"])
    assert "recorded eval/sim/accept_length (train with data.eval_samples > 0)" in capsys.readouterr().err


def test_an_export_stores_its_weights_in_the_precision_the_run_trained_in(tmp_path, tiny_target_dir, prepared_dir):
    from draftsmith.inference.methods.learned import load_drafter
    from draftsmith.inference.runtime import generate
    from draftsmith.train.commands import EXPORT_DTYPES
    from draftsmith.train.export import DTYPES_BY_FORMAT, STORAGE_DTYPES

    assert set(EXPORT_DTYPES) == {dtype for dtypes in DTYPES_BY_FORMAT.values() for dtype in dtypes}
    assert DTYPES_BY_FORMAT["draftsmith"] == tuple(STORAGE_DTYPES)
    recipe_path = write_recipe(tmp_path, tiny_target_dir, prepared_dir)
    recipe = load_train_recipe(recipe_path, ["train.max_steps=1"])
    train(recipe)  # in float32 (one process keeps one accelerate precision: a bf16 run is said in run_info)
    run = Path(recipe.output_dir)
    checkpoint = load_file(str(latest_checkpoint(run) / "drafter" / "model.safetensors"))
    main(["export", str(run), "--out", str(tmp_path / "fp32-run")])
    info = json.loads((run / "run_info.json").read_text())
    (run / "run_info.json").write_text(json.dumps({**info, "mixed_precision": "bf16"}))
    exports = {tmp_path / "fp32-run": torch.float32}
    for flag, dtype in (([], torch.bfloat16), (["--dtype", "float32"], torch.float32)):
        exports[tmp_path / f"export-{dtype}"] = dtype
        main(["export", str(run), "--out", str(tmp_path / f"export-{dtype}"), *flag])
    for out, dtype in exports.items():
        stored = load_file(str(out / "model.safetensors"))
        assert set(stored) == set(checkpoint)
        for name, tensor in checkpoint.items():
            expected = tensor.to(dtype) if tensor.is_floating_point() else tensor
            assert stored[name].dtype == expected.dtype and torch.equal(stored[name], expected), name
    target = load_target(str(tiny_target_dir))
    drafter = load_drafter(tmp_path / f"export-{torch.bfloat16}", target)
    prompt = target.encode_chat([{"role": "user", "content": "tell me about the sea"}])
    plain = generate(target.model, prompt, max_new_tokens=24)
    drafted = generate(target.model, prompt, drafter, max_new_tokens=24)
    assert drafted.tokens == plain.tokens
    with pytest.raises(SystemExit):
        main(["export", str(run), "--out", str(tmp_path / "engine"), "--format", "vllm", "--dtype", "bfloat16"])


def test_export_for_vllm_checks_the_verifier(tmp_path, tiny_target_dir, other_target_dir, prepared_dir, capsys):
    from draftsmith.train.commands import EXPORT_FORMATS
    from draftsmith.train.export import FORMATS

    assert EXPORT_FORMATS == FORMATS
    recipe_path = write_recipe(tmp_path, tiny_target_dir, prepared_dir, drafter={"family": "eagle"})
    recipe = load_train_recipe(recipe_path, ["train.max_steps=1", "train.save_every=1"])
    train(recipe)
    out = tmp_path / "vllm"
    main(["export", recipe.output_dir, "--out", str(out), "--format", "vllm"])
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "fc.weight" in load_file(str(out / "model.safetensors"))
    record = config["draftsmith_export"]
    assert record["family"] == "eagle" and record["format"] == "vllm" and record["speculative_tokens"] == 5
    main(["export", recipe.output_dir, "--out", str(out), "--format", "vllm", "--overwrite"])  # its own export
    with pytest.raises(SystemExit):  # the drafter was trained for another target
        main(
            [
                "export",
                recipe.output_dir,
                "--out",
                str(tmp_path / "x"),
                "--format",
                "vllm",
                "--verifier",
                str(other_target_dir),
            ]
        )
    assert "not the verifier" in capsys.readouterr().err and not (tmp_path / "x").exists()
    main(["export", recipe.output_dir, "--out", str(tmp_path / "hub"), "--format", "vllm", "--verifier", "org/tiny"])
    assert json.loads((tmp_path / "hub/config.json").read_text())["draftsmith_export"]["family"] == "eagle"


def test_wandb_offline_run_writes_its_files(tmp_path, recipe_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    recipe = load_train_recipe(recipe_path, ["tracking.wandb=true", "train.max_steps=2", "tracking.run_name=t"])
    train(recipe)
    runs = list((tmp_path / "wandb-home" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("run-*.wandb"))
    run_id = (Path(recipe.output_dir) / "wandb_run_id.txt").read_text().strip()
    assert runs[0].name.endswith(run_id)


def _launch(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)


@pytest.mark.slow
def test_two_process_deepspeed_zero2_equals_one_process(tmp_path, tiny_target_dir, prepared_dir):
    """Two CPU processes under DeepSpeed ZeRO-2 (gloo) = one process accumulating the same two micro-batches,
    also across a resume (the DeepSpeed engine's state is restored)."""
    recipe = write_recipe(tmp_path, tiny_target_dir, prepared_dir)
    common = ["loss.feature_noise=0", "train.save_every=3", "train.grad_clip=0.5"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "WANDB_MODE": "disabled"}
    accelerate = shutil.which("accelerate", path=str(Path(sys.executable).parent)) or "accelerate"
    two = [
        accelerate,
        "launch",
        "--config_file",
        str(REPO / "recipes/accelerate/zero2.yaml"),
        "--num_processes",
        "2",
        "-m",
        "draftsmith.train",
        str(recipe),
        *common,
        f"output_dir={tmp_path / 'two'}",
    ]
    one = [
        sys.executable,
        "-m",
        "draftsmith.cli",
        "train",
        str(recipe),
        *common,
        "train.grad_accum=2",
        f"output_dir={tmp_path / 'one'}",
    ]
    for command in (two, one):
        for extra in (["train.max_steps=3"], ["train.max_steps=4", "--resume"]):
            result = _launch(command + extra, env)
            assert result.returncode == 0, result.stderr[-3000:]
    info_two = json.loads((tmp_path / "two/run_info.json").read_text())
    assert info_two["world_size"] == 2 and info_two["deepspeed_zero_stage"] == 2 and info_two["global_batch"] == 4
    assert json.loads((tmp_path / "one/run_info.json").read_text())["world_size"] == 1
    curve_one, curve_two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert sorted(curve_two) == sorted(curve_one) == [1, 2, 3, 4]
    for step in curve_one:
        assert curve_two[step] == pytest.approx(curve_one[step], rel=1e-5)
    weights_one = load_file(str(tmp_path / "one/checkpoints/step-4/drafter/model.safetensors"))
    weights_two = load_file(str(tmp_path / "two/checkpoints/step-4/drafter/model.safetensors"))
    assert weights_one.keys() == weights_two.keys()
    for key in weights_one:
        torch.testing.assert_close(weights_two[key], weights_one[key], rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_eagle3_under_two_process_deepspeed_zero3_equals_one_process(tmp_path, tiny_target_dir, prepared_dir, capsys):
    """EAGLE-3's loss calls the drafter's ``norm``/``lm_head`` outside its forward, which ZeRO-3's partitioned
    parameters must survive: two CPU processes under ZeRO-3 train (loss falling) exactly as one process
    accumulating the same two micro-batches, and the checkpoint and both exports hold the full weights."""
    options = {"aux_layer_ids": [0, 1], "draft_vocab_size": 64, "ttt_steps": 2}
    recipe = write_recipe(tmp_path, tiny_target_dir, prepared_dir, drafter={"family": "eagle3", **options})
    recipe.write_text(yaml.safe_dump({**yaml.safe_load(recipe.read_text()), "loss": {"decay": 0.8}}))
    common = ["train.max_steps=6", "train.save_every=3", "train.lr=1e-2", "train.grad_clip=0.5", "data.eval_samples=4"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "WANDB_MODE": "disabled"}
    accelerate = shutil.which("accelerate", path=str(Path(sys.executable).parent)) or "accelerate"
    config = str(REPO / "recipes/accelerate/zero3.yaml")
    two = [accelerate, "launch", "--config_file", config, "--num_processes", "2", "-m", "draftsmith.train"]
    one = [sys.executable, "-m", "draftsmith.cli", "train"]
    for command, extra in ((two, []), (one, ["train.grad_accum=2"])):
        name = "two" if command is two else "one"
        result = _launch([*command, str(recipe), *common, *extra, f"output_dir={tmp_path / name}"], env)
        assert result.returncode == 0, result.stderr[-3000:]
    info = json.loads((tmp_path / "two/run_info.json").read_text())
    assert info["world_size"] == 2 and info["deepspeed_zero_stage"] == 3 and info["global_batch"] == 4
    curve_one, curve_two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert sorted(curve_two) == sorted(curve_one) == [1, 2, 3, 4, 5, 6]
    for step in curve_one:
        assert curve_two[step] == pytest.approx(curve_one[step], rel=1e-5)
    held_out = [json.loads(line) for line in (tmp_path / "two/metrics.jsonl").read_text().splitlines()]
    held_out = {record["step"]: record["eval/loss"] for record in held_out if "eval/loss" in record}
    assert held_out[6] < held_out[3]  # the same held-out samples: it learns (a tiny random target teaches little)
    weights_one = load_file(str(tmp_path / "one/checkpoints/step-6/drafter/model.safetensors"))
    weights_two = load_file(str(tmp_path / "two/checkpoints/step-6/drafter/model.safetensors"))
    fresh = load_target(str(tiny_target_dir)).model.config
    shapes = {k: tuple(v.shape) for k, v in get_family("eagle3").build(fresh, options).state_dict().items()}
    assert {k: tuple(v.shape) for k, v in weights_two.items()} == shapes  # full tensors, none left partitioned
    for key in weights_one:
        torch.testing.assert_close(weights_two[key], weights_one[key], rtol=1e-4, atol=1e-6)
    exported = tmp_path / "export"
    main(["export", str(tmp_path / "two"), "--out", str(exported)])
    main(["export", str(tmp_path / "two"), "--out", str(tmp_path / "vllm"), "--format", "speculators"])
    assert load_file(str(exported / "model.safetensors")).keys() <= weights_two.keys()
    for key, tensor in load_file(str(exported / "model.safetensors")).items():
        assert torch.equal(tensor, weights_two[key]), key
    engine = load_file(str(tmp_path / "vllm/model.safetensors"))
    assert torch.equal(engine["lm_head.weight"], weights_two["lm_head.weight"])
    assert torch.equal(engine["layers.0.self_attn.q_proj.weight"], weights_two["layer.self_attn.q_proj.weight"])


def test_eagle3_reads_its_declared_layers_offline_and_online(tmp_path, tiny_target_dir, prepared_dir, capsys):
    """The fused layers come from the drafter's config alone: `cache-features --recipe` caches them, the
    trainer checks the cache holds them and hands the same states offline as online."""
    drafter = {"family": "eagle3", "aux_layer_ids": [0, 1], "draft_vocab_size": 64, "ttt_steps": 2}
    cache, bare = tmp_path / "features", tmp_path / "bare"
    recipe = write_recipe(tmp_path / "r", tiny_target_dir, prepared_dir, drafter=drafter, data={"features": str(cache)})
    recipe.write_text(yaml.safe_dump({**yaml.safe_load(recipe.read_text()), "loss": {"decay": 0.8}}))
    target = ["--target", str(tiny_target_dir), "--dtype", "fp32"]
    main(["data", "cache-features", str(prepared_dir), "--out", str(bare), *target])
    with pytest.raises(FeatureCacheError, match=r"lacks the target states \[0, 1\].*--layers 0,1 --overwrite"):
        Trainer(load_train_recipe(recipe, [f"data.features={bare}"]))
    main(["data", "cache-features", str(prepared_dir), "--out", str(cache), "--recipe", str(recipe), *target])
    assert json.loads((cache / "manifest.json").read_text())["layers"] == [0, 1]
    result = train(load_train_recipe(recipe, ["train.max_steps=2"]))
    assert all(math.isfinite(loss) for loss in losses(result.output_dir).values())
    trainer = Trainer(load_train_recipe(recipe, ["output_dir=" + str(tmp_path / "x")]))
    indices = trainer.data.global_batch(0, trainer.plan, 0)
    cached = trainer.data.collate(indices)
    trainer.data.cache = None
    computed = trainer._batch(indices)
    real = cached.attention_mask.bool()
    assert cached.drafter_states.shape[-1] == 2 * cached.hidden_states.shape[-1]
    torch.testing.assert_close(cached.drafter_states[real], computed.drafter_states[real], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(cached.hidden_states[real], computed.hidden_states[real], rtol=1e-4, atol=1e-5)
    # the target's greedy tokens come with the cached batch alone, as its lm_head gives them
    greedy = trainer.frozen.lm_head(cached.hidden_states).argmax(-1)
    assert computed.target_argmax is None and torch.equal(cached.target_argmax[real], greedy[real])


def test_throughput_times_the_recipes_step_and_reports_padding(recipe_path, prepared_dir, tmp_path, capsys):
    from draftsmith.train.throughput import main as throughput

    scratch = tmp_path / "scratch"
    throughput(
        [str(recipe_path), str(prepared_dir), "--steps", "2", "--scratch", str(scratch), "data.group_by_length=true"]
    )
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("fspad: ") and " tokens/s (" in line and "padded/real 1." in line
    assert not scratch.exists()


@pytest.mark.parametrize("native", [True, False])
def test_auto_precision_on_a_cpu_stays_float32_and_names_bf16_where_it_is_native(monkeypatch, capsys, native):
    """auto keeps float32 on a CPU (every process alike, runs reproducible across machines); where the
    CPU multiplies bfloat16 in hardware, one line says what bf16 would give."""
    from draftsmith.train import trainer
    from draftsmith.train.recipe import TrainSection

    monkeypatch.setattr(trainer, "native_bf16_cpu", lambda: native)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    accelerator = trainer.build_accelerator(TrainSection())
    assert str(accelerator.mixed_precision) == "no"
    assert (trainer.BF16_HINT in capsys.readouterr().err) == native
