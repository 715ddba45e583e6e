"""Feature cache: round trip against a direct target forward, resume, and corruption detection."""

import hashlib
import json

import pytest
import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from conftest import sharegpt, write_jsonl
from draftsmith.cli import main
from draftsmith.core.target import load_target
from draftsmith.data.features import (
    SCREEN_CANDIDATES,
    CacheSettings,
    FeatureCache,
    FeatureCacheError,
    HeadArgmax,
    build_feature_cache,
)
from draftsmith.data.prepared import PreparedDataError, PreparedDataset


@pytest.fixture()
def prepared(tmp_path, tiny_target_dir, chat_records):
    records = chat_records + [sharegpt(("human", f"Question {i}?"), ("gpt", "Answer " * (i + 1))) for i in range(5)]
    data = write_jsonl(tmp_path / "d.jsonl", records)
    out = tmp_path / "prepared"
    main(["data", "prepare", str(data), "--out", str(out), "--target", str(tiny_target_dir)])
    return PreparedDataset(out)


@pytest.fixture(scope="module")
def tiny_target(tiny_target_dir):
    return load_target(str(tiny_target_dir))


def small_shards(**kw):
    return CacheSettings(shard_tokens=60, batch_tokens=128, **kw)


def test_round_trip_matches_the_target_forward(tmp_path, prepared, tiny_target):
    out = tmp_path / "cache"
    manifest = build_feature_cache(prepared, tiny_target, out, small_shards(dtype="fp32", layers=(0, 1)))
    assert manifest["complete"] and len(manifest["shards"]) > 2
    cache = FeatureCache(out)
    assert len(cache) == len(prepared) and cache.n_tokens == int(prepared.offsets[-1])
    for index in range(len(prepared)):
        item, sample = cache[index], prepared[index]
        assert item["id"] == sample.id
        assert torch.equal(item["input_ids"], sample.input_ids) and torch.equal(item["loss_mask"], sample.loss_mask)
        with torch.no_grad():
            direct = tiny_target.model(sample.input_ids[None], output_hidden_states=True).hidden_states
        # unpadded forward vs padded batch: same math, float32 reassociation only
        torch.testing.assert_close(item["feature"], direct[-1][0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(item["hidden_states.0"], direct[0][0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(item["hidden_states.1"], direct[1][0], rtol=1e-4, atol=1e-5)
        # the target's greedy token from the feature as stored: what a step would compute from it
        assert item["target_argmax"].dtype == torch.int32
        assert torch.equal(item["target_argmax"].long(), tiny_target.model.lm_head(item["feature"]).argmax(-1))
    assert cache.identity == tiny_target.identity and manifest["target_argmax"]


def test_a_target_run_in_bf16_caches_the_float32_heads_greedy_tokens(tmp_path, prepared, tiny_target_dir):
    """`--model-dtype bfloat16` (twice the speed on a CPU with native bf16): the features come from the bf16
    forward, and the greedy tokens are the float32 head's on them, as stored (what a training step reads)."""
    target = load_target(str(tiny_target_dir), dtype="bfloat16")
    build_feature_cache(prepared, target, tmp_path / "cache", small_shards(dtype="bf16"))
    cache, head = FeatureCache(tmp_path / "cache"), target.model.lm_head.weight.float()
    for index in range(len(prepared)):
        item = cache[index]
        assert item["feature"].dtype == torch.bfloat16
        assert torch.equal(item["target_argmax"].long(), (item["feature"].float() @ head.T).argmax(-1))


def exact_argmax(head: torch.nn.Linear, rows: torch.Tensor) -> torch.Tensor:
    """The float64 logits' argmax (bfloat16 products are exact there), the first of equal maxima."""
    return (rows.double() @ head.weight.double().T).argmax(-1)


def test_a_bf16_head_screens_and_finds_the_exact_logits_argmax():
    """A bf16 head on the CPU: the screen's tokens are the exact logits' argmax, near ties included."""
    torch.manual_seed(0)
    head = torch.nn.Linear(96, 500, bias=False).bfloat16()
    rows = torch.randn(300, 96).bfloat16()
    near = head.weight[7] + torch.randn(96).bfloat16() * 2.0**-9  # a row almost the same as token 7's
    head.weight.data[11] = near
    rows[:40] = head.weight[7]  # these rows' two best tokens, 7 and 11, lie far closer than bf16's rounding
    argmax = HeadArgmax(head, chunk_rows=64)
    assert argmax._screens(rows)
    tokens = argmax(rows.view(3, 100, 96))
    assert tokens.dtype == torch.int32 and tokens.shape == (3, 100)
    assert torch.equal(tokens.view(-1).long(), exact_argmax(head, rows))


def test_a_screen_with_more_tokens_near_its_best_than_it_checks_computes_the_row_whole():
    """Twenty tokens' logits round to one bfloat16 value, and the exact best is one the screen's top
    candidates leave out: the screen cannot tell, so the row is summed whole in float64 (checking only
    its candidates would pick a wrong token)."""
    head = torch.nn.Linear(2, 20, bias=False).bfloat16()
    rows = torch.tensor([[1.0, 1.0]]).bfloat16()
    with torch.no_grad():
        head.weight[:, 0] = 1.0
        head.weight[:, 1] = 0.0
        screened = torch.nn.functional.linear(rows, head.weight).topk(SCREEN_CANDIDATES).indices[0].tolist()
        best = min(set(range(20)) - set(screened))
        head.weight[:, 1] = torch.arange(20) * 2.0**-14  # bf16 values; 1 + any of them rounds to 1 in bf16
        head.weight[[best, 19], 1] = head.weight[[19, best], 1]
    assert torch.nn.functional.linear(rows, head.weight).unique().numel() == 1
    assert HeadArgmax(head)(rows).item() == best == exact_argmax(head, rows).item()


def test_a_bf16_head_smaller_than_the_screens_candidates_is_still_its_exact_argmax():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, SCREEN_CANDIDATES - 3, bias=False).bfloat16()
    rows = torch.randn(6, 8).bfloat16()
    assert torch.equal(HeadArgmax(head)(rows).long(), exact_argmax(head, rows))


def test_a_float32_head_or_rows_off_the_bf16_grid_take_the_float32_product():
    torch.manual_seed(0)
    head32 = torch.nn.Linear(16, 50, bias=False)
    rows = torch.randn(5, 16)
    assert not HeadArgmax(head32)._screens(rows.bfloat16())
    assert torch.equal(HeadArgmax(head32)(rows).long(), head32(rows).argmax(-1))
    head16 = torch.nn.Linear(16, 50, bias=False).bfloat16()
    assert not HeadArgmax(head16)._screens(rows) and HeadArgmax(head16)._screens(rows.bfloat16().float())
    assert torch.equal(HeadArgmax(head16)(rows).long(), (rows @ head16.weight.float().T).argmax(-1))


def test_a_cache_begun_without_greedy_tokens_is_finished_without_them(tmp_path, prepared, tiny_target):
    """A cache started before the target's greedy tokens were kept resumes as it began (its shards all
    lack them), and training computes them in the step."""
    out = tmp_path / "cache"

    def stop_after_first_shard(index):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_feature_cache(prepared, tiny_target, out, small_shards(), on_shard=stop_after_first_shard)
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["target_argmax"]  # as the older release wrote it, and its first shard without the tokens
    shard = out / manifest["shards"][0]["file"]
    tensors = safetensors_load(shard.read_bytes())
    del tensors["target_argmax"]
    blob = safetensors_save(tensors)
    shard.write_bytes(blob)
    manifest["shards"][0].update(bytes=len(blob), sha256=hashlib.sha256(blob).hexdigest())
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert not build_feature_cache(prepared, tiny_target, out, small_shards())["target_argmax"]
    cache = FeatureCache(out)
    assert all("target_argmax" not in cache[i] for i in range(len(cache)))


def test_bf16_is_the_default_and_halves_the_bytes(tmp_path, prepared, tiny_target):
    fp32 = build_feature_cache(prepared, tiny_target, tmp_path / "fp32", small_shards(dtype="fp32"))
    bf16 = build_feature_cache(prepared, tiny_target, tmp_path / "bf16", small_shards())
    assert FeatureCache(tmp_path / "bf16")[0]["feature"].dtype == torch.bfloat16
    assert bf16["dtype"] == "bf16"
    assert sum(s["bytes"] for s in bf16["shards"]) < 0.6 * sum(s["bytes"] for s in fp32["shards"])


def test_interrupted_run_resumes_to_the_same_cache(tmp_path, prepared, tiny_target):
    whole = tmp_path / "whole"
    build_feature_cache(prepared, tiny_target, whole, small_shards())
    part = tmp_path / "part"

    def die_after_second_shard(index):
        if index == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_feature_cache(prepared, tiny_target, part, small_shards(), on_shard=die_after_second_shard)
    partial = json.loads((part / "manifest.json").read_text())
    assert len(partial["shards"]) == 2 and not partial["complete"]
    with pytest.raises(FeatureCacheError, match="incomplete"):
        FeatureCache(part)
    resumed_shards = []
    build_feature_cache(prepared, tiny_target, part, small_shards(), on_shard=resumed_shards.append)
    assert resumed_shards[0] == 2  # the finished shards were not recomputed
    a, b = json.loads((whole / "manifest.json").read_text()), json.loads((part / "manifest.json").read_text())
    assert [s["sha256"] for s in a["shards"]] == [s["sha256"] for s in b["shards"]]


def test_resume_with_other_settings_is_refused(tmp_path, prepared, tiny_target):
    out = tmp_path / "cache"
    build_feature_cache(prepared, tiny_target, out, small_shards())
    with pytest.raises(FeatureCacheError, match="another dtype"):
        build_feature_cache(prepared, tiny_target, out, small_shards(dtype="fp32"))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda b: b[: len(b) // 2], "truncated"),
        (lambda b: b[:-10] + bytes(x ^ 0xFF for x in b[-10:]), "does not match its checksum"),
    ],
)
def test_damaged_shards_are_reported_not_used(tmp_path, prepared, tiny_target, damage, message):
    out = tmp_path / "cache"
    build_feature_cache(prepared, tiny_target, out, small_shards())
    shard = out / "shard-00001.safetensors"
    shard.write_bytes(damage(shard.read_bytes()))
    cache = FeatureCache(out)
    cache[0]  # shard 0 is intact and still readable
    with pytest.raises(FeatureCacheError, match=message):
        cache.verify()
    with pytest.raises(FeatureCacheError, match=message):
        [cache[i] for i in range(len(cache))]


def test_cache_refuses_data_prepared_for_another_target(tmp_path, prepared, other_target_dir):
    with pytest.raises(PreparedDataError, match="another target"):
        build_feature_cache(prepared, load_target(str(other_target_dir)), tmp_path / "c", small_shards())


def test_cli_prints_bytes_per_token_and_verifies(tmp_path, prepared, tiny_target_dir, capsys):
    out = tmp_path / "cache"
    main(
        [
            "data",
            "cache-features",
            str(prepared.path),
            "--out",
            str(out),
            "--target",
            str(tiny_target_dir),
            "--shard-tokens",
            "100",
        ]
    )
    printed = capsys.readouterr().out
    # bf16 feature (64 x 2 bytes) + int32 id + uint8 mask + int32 greedy token per token, plus headers
    per_token = int(printed.split(" bytes per token")[0].split("= ")[-1])
    assert 64 * 2 + 9 <= per_token < 64 * 2 + 44
    main(["data", "cache-features", "--out", str(out), "--verify"])
    assert "verified" in capsys.readouterr().out


@pytest.mark.parametrize(
    "order, message",
    [
        ({"train_samples": 3}, "--train-samples needs --eval-samples"),
        ({"eval_samples": 2, "train_samples": 99}, "--train-samples 99: choose from 1 to the"),
        ({"eval_samples": 99}, "--eval-samples 99: choose from 0 to"),
    ],
)
def test_a_cache_order_that_cannot_be_met_is_refused(tmp_path, prepared, tiny_target, order, message):
    with pytest.raises(FeatureCacheError, match=message):
        build_feature_cache(prepared, tiny_target, tmp_path / "cache", small_shards(**order))
    assert not (tmp_path / "cache" / "manifest.json").exists()


def test_a_cache_written_before_orders_reads_and_resumes_in_the_prepared_order(tmp_path, prepared, tiny_target):
    out = tmp_path / "cache"
    build_feature_cache(prepared, tiny_target, out, small_shards(dtype="fp32"))
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["order"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    cache = FeatureCache(out)
    assert cache.eval_order is None and cache.rows(len(prepared)) == list(range(len(prepared)))
    build_feature_cache(prepared, tiny_target, out, small_shards(dtype="fp32"))  # resumes: the same order
    with pytest.raises(FeatureCacheError, match="another sample order"):
        build_feature_cache(prepared, tiny_target, out, small_shards(dtype="fp32", eval_samples=2))
