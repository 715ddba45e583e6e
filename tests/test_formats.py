"""Dataset readers: every supported layout, and every kind of bad input."""

import json

import pytest

from conftest import sharegpt, write_jsonl
from draftsmith.data.formats import DataError, ReadStats, RecordError, normalize_record, read_conversations


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


def test_missing_file_directory_and_binary_file(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        _read(tmp_path / "nope.json")
    with pytest.raises(DataError, match="is a directory"):
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
