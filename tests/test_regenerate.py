"""Regeneration: turn-by-turn conditioning, resume after an interruption, and refusals."""

import json

import pytest

from conftest import sharegpt, write_jsonl
from draftsmith.core.target import load_target
from draftsmith.data.regenerate import RegenerateError, RegenerateSettings, _generate_batch, meta_path, regenerate


@pytest.fixture(scope="module")
def tiny_target(tiny_target_dir):
    return load_target(str(tiny_target_dir))


@pytest.fixture()
def source(tmp_path):
    records = [
        sharegpt(
            ("human", "What is the capital of France?"),
            ("gpt", "old answer"),
            ("human", "And a poem?"),
            ("gpt", "old poem"),
            id="two-turns",
        ),
        sharegpt(("human", "Two plus two?"), id="prompt-only"),
        sharegpt(("system", "Be brief."), ("human", "Hello!"), ("gpt", "old"), id="with-system"),
        sharegpt(("human", "Summarise the passage."), ("gpt", "old"), id="d"),
        sharegpt(("gpt", "assistant first"), ("human", "x"), id="bad"),
        sharegpt(("human", "Two plus two?"), id="prompt-only"),
    ]
    return write_jsonl(tmp_path / "src.jsonl", records)


SETTINGS = RegenerateSettings(max_new_tokens=6, batch_size=1)


def read_out(path):
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}


def test_every_turn_is_regenerated_from_the_regenerated_history(tmp_path, source, tiny_target):
    out = tmp_path / "out.jsonl"
    report = regenerate(str(source), out, tiny_target, SETTINGS)
    assert report.stats.read == 6 and report.written == 4
    assert dict(report.stats.skipped) == {"assistant_first": 1, "duplicate_id": 1}
    records = read_out(out)
    assert set(records) == {"two-turns", "prompt-only", "with-system", "d"}
    turns = records["two-turns"]["conversations"]
    assert [t["from"] for t in turns] == ["human", "gpt", "human", "gpt"]
    assert "old" not in turns[1]["value"] and "old" not in turns[3]["value"]
    history = [{"role": "user", "content": turns[0]["value"]}]
    first = _generate_batch(tiny_target, [history], SETTINGS)[0][0]
    assert turns[1]["value"] == first
    history += [{"role": "assistant", "content": first}, {"role": "user", "content": turns[2]["value"]}]
    assert turns[3]["value"] == _generate_batch(tiny_target, [history], SETTINGS)[0][0]
    assert records["prompt-only"]["conversations"][1]["from"] == "gpt"  # a reply was added to the prompt
    meta = json.loads(meta_path(out).read_text())
    assert meta["target"] == tiny_target.identity.to_dict()


def test_interrupted_run_resumes_and_matches_an_uninterrupted_one(tmp_path, source, tiny_target):
    whole = tmp_path / "whole.jsonl"
    regenerate(str(source), whole, tiny_target, SETTINGS)
    part = tmp_path / "part.jsonl"
    first = regenerate(str(source), part, tiny_target, SETTINGS, limit=2)
    assert first.written == 2
    with open(part, "a") as handle:  # the process died while writing the next record
        handle.write('{"id": "with-system", "conversa')
    second = regenerate(str(source), part, tiny_target, SETTINGS)
    assert second.already_done == 2 and second.written == 2
    assert second.stats.used + second.stats.n_skipped == second.stats.read
    assert read_out(part) == read_out(whole)
    third = regenerate(str(source), part, tiny_target, SETTINGS)
    assert third.written == 0 and third.already_done == 4


def test_batched_generation_writes_every_conversation(tmp_path, source, tiny_target):
    out = tmp_path / "batched.jsonl"
    report = regenerate(str(source), out, tiny_target, RegenerateSettings(max_new_tokens=4, batch_size=3))
    assert report.written == 4 and len(read_out(out)) == 4 and report.new_tokens > 0


def test_sampled_regeneration_is_reproducible_with_a_seed(tmp_path, source, tiny_target):
    sampled = RegenerateSettings(max_new_tokens=8, batch_size=1, temperature=1.0, seed=3)
    regenerate(str(source), tmp_path / "a.jsonl", tiny_target, sampled)
    regenerate(str(source), tmp_path / "b.jsonl", tiny_target, sampled)
    assert read_out(tmp_path / "a.jsonl") == read_out(tmp_path / "b.jsonl")


def test_resume_with_other_settings_or_target_is_refused(tmp_path, source, tiny_target, other_target_dir):
    out = tmp_path / "out.jsonl"
    regenerate(str(source), out, tiny_target, SETTINGS, limit=1)
    with pytest.raises(RegenerateError, match="another settings"):
        regenerate(str(source), out, tiny_target, RegenerateSettings(max_new_tokens=9, batch_size=1))
    with pytest.raises(RegenerateError, match="another target"):
        regenerate(str(source), out, load_target(str(other_target_dir)), SETTINGS)


def test_output_that_is_not_ours_is_refused(tmp_path, source, tiny_target):
    out = tmp_path / "out.jsonl"
    out.write_text("not json\n")
    with pytest.raises(RegenerateError, match="line 1 is not a regenerated record"):
        regenerate(str(source), out, tiny_target, SETTINGS)
    assert out.read_text() == "not json\n"


def test_named_sharegpt_regenerates_chunks_without_their_leading_answer(tmp_path, tiny_target, fake_sharegpt_package):
    from conftest import cut_json_array

    records = [
        sharegpt(("gpt", "the end of an earlier answer"), ("human", "Two plus two?"), ("gpt", "old"), id="chunk"),
        sharegpt(("human", "Hello!"), id="prompt-only"),
        sharegpt(("human", "cut"), ("gpt", "off"), id="cut"),
    ]
    fake_sharegpt_package(cut_json_array(records, keep=2))
    out = tmp_path / "out.jsonl"
    report = regenerate("sharegpt", out, tiny_target, SETTINGS)
    assert report.written == 2 and report.stats.dropped_leading_assistant == 1
    assert report.stats.truncation.complete_records == 2
    chunk = read_out(out)["chunk"]["conversations"]
    assert [t["from"] for t in chunk] == ["human", "gpt"] and chunk[0]["value"] == "Two plus two?"
    assert json.loads(meta_path(out).read_text())["source"] == "sharegpt"


def test_limit_and_shards_pick_a_spread_subset_and_resume(tmp_path, tiny_target):
    records = [sharegpt(("human", f"Question {i}?"), id=f"q{i}") for i in range(12)]
    source = write_jsonl(tmp_path / "many.jsonl", records)
    out = tmp_path / "sample.jsonl"
    first = regenerate(str(source), out, tiny_target, SETTINGS, limit=3)
    assert first.written == 3 and first.stats.sampled_from == 12
    picked = set(read_out(out))
    assert picked != {"q0", "q1", "q2"}
    grown = regenerate(str(source), out, tiny_target, SETTINGS, limit=5)  # resumes: the 3 are kept
    assert grown.already_done == 3 and grown.written == 2 and picked < set(read_out(out))
    halves = [tmp_path / "s0.jsonl", tmp_path / "s1.jsonl"]
    for i, half in enumerate(halves):
        regenerate(str(source), half, tiny_target, SETTINGS, shard=(i, 2))
    assert set(read_out(halves[0])) | set(read_out(halves[1])) == {f"q{i}" for i in range(12)}
    assert not set(read_out(halves[0])) & set(read_out(halves[1]))
    assert json.loads(meta_path(halves[1]).read_text())["sample"] == {"limit": None, "shard": 1, "n_shards": 2}


def test_batches_hold_prompts_of_similar_length_first_turns_first(tmp_path, tiny_target, monkeypatch):
    import draftsmith.data.regenerate as regen

    records = [
        sharegpt(("human", "x" * length), ("gpt", "old"), ("human", "again?"), ("gpt", "old"), id=f"c{length}")
        for length in (40, 3, 25, 1, 33, 12, 7, 19)
    ]
    source = write_jsonl(tmp_path / "lengths.jsonl", records)
    calls = []
    real = regen._generate_batch

    def recording(target, prompts, settings):
        calls.append([(len(p), len(p[0]["content"])) for p in prompts])
        return real(target, prompts, settings)

    monkeypatch.setattr(regen, "_generate_batch", recording)
    report = regenerate(
        str(source), tmp_path / "o.jsonl", tiny_target, RegenerateSettings(max_new_tokens=2, batch_size=3)
    )
    assert report.written == 8 and [len(c) for c in calls] == [3, 3, 2, 3, 3, 2]
    first_round = [length for call in calls[:3] for _, length in call]
    assert first_round == [1, 3, 7, 12, 19, 25, 33, 40] and all(turns == 1 for call in calls[:3] for turns, _ in call)
    assert all(turns == 3 for call in calls[3:] for turns, _ in call)  # second turns only after every first one


def test_bad_shard_is_one_clear_line(tmp_path, capsys):
    from draftsmith.train.cli import main

    for bad in ("2/2", "x", "1/0"):
        with pytest.raises(SystemExit) as info:
            main(["data", "regenerate", str(tmp_path / "in.jsonl"), "--out", str(tmp_path / "o"), "--shard", bad])
        assert info.value.code == 2
        assert f"--shard takes I/N with 0 <= I < N (e.g. 0/4), got {bad!r}" in capsys.readouterr().err


def test_threads_option_sets_torch_threads(tmp_path, source, tiny_target_dir):
    import torch

    from draftsmith.train.cli import main

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        out = tmp_path / "o.jsonl"
        args = ["data", "regenerate", str(source), "--out", str(out), "--target", str(tiny_target_dir)]
        main([*args, "--max-new-tokens", "2", "--limit", "1", "--threads", "1"])
        assert torch.get_num_threads() == 1 and len(read_out(out)) == 1
    finally:
        torch.set_num_threads(before)
