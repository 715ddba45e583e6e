"""The command line: help everywhere, required arguments, shipped data."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from draftsmith.cli import main
from draftsmith.data.cli import default_dataset_path
from draftsmith.data.formats import ReadStats, read_conversations

COMMANDS = [
    [],
    ["data"],
    ["data", "prepare"],
    ["data", "show"],
    ["data", "regenerate"],
    ["data", "cache-features"],
    ["train"],
    ["export"],
    ["generate"],
    ["bench"],
]


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: " ".join(a) or "draftsmith")
def test_help_everywhere(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv + ["--help"])
    assert info.value.code == 0
    assert "usage: draftsmith" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["train", "export"])
def test_train_and_export_need_their_arguments(command, capsys):
    with pytest.raises(SystemExit) as info:
        main([command])
    assert info.value.code == 2 and "required" in capsys.readouterr().err


def test_console_script_is_installed():
    script = Path(sys.executable).with_name("draftsmith")  # beside the interpreter of this environment
    assert script.is_file(), f"{script} is missing: install the package (pip install -e .)"
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "usage: draftsmith" in result.stdout and "data" in result.stdout


def test_the_first_bundled_sharegpt_smollm2_stays_as_it_was_measured():
    """sharegpt-smollm2-v1 (the figures of earlier notes were measured on it) reads by name, every record
    is a user turn and SmolLM2's answer, its meta names the embedded target's exact identity (GGUF hash)
    and the command that made it."""
    from draftsmith.core.io import sha256_file
    from draftsmith.core.target import smollm2_gguf_path
    from draftsmith.data.cli import _source

    path = Path(_source("sharegpt-smollm2-v1"))
    assert path.name == "sharegpt_smollm2.jsonl.gz" and path.is_file()
    stats = ReadStats()
    conversations = list(read_conversations(str(path), stats))
    meta = json.loads(path.with_name("sharegpt_smollm2.jsonl.meta.json").read_text())
    assert stats.read == len(conversations) == meta["conversations"] >= 1500 and not stats.skipped
    assert all([t["role"] for t in c.turns][-2:] == ["user", "assistant"] for c in conversations)
    assert len({c.id for c in conversations}) == len(conversations)
    assert meta["target"]["revision"] == "gguf-sha256-" + sha256_file(smollm2_gguf_path())
    assert meta["settings"]["max_turns"] == 1 and "draftsmith data regenerate sharegpt" in meta["command"]


def test_bundled_sharegpt_smollm2_is_every_shard_whole_with_its_meta():
    """sharegpt-smollm2 (a folder of 8 shards, read by name as one set): each shard's records are whole
    two-turn-at-most conversations its meta counts, none twice in the set, made for the embedded target
    by the command the meta records; 17,306 in all (the whole ShareGPT file's usable conversations)."""
    from draftsmith.core.io import sha256_file
    from draftsmith.core.target import smollm2_gguf_path
    from draftsmith.data.cli import _source
    from draftsmith.data.formats import shard_files

    folder = Path(_source("sharegpt-smollm2"))
    shards = shard_files(folder)
    assert [s.name for s in shards] == [f"shard-{i}-of-8.jsonl.gz" for i in range(8)]
    seen: list[str] = []
    for shard in shards:
        stats = ReadStats()
        conversations = list(read_conversations(str(shard), stats))
        meta = json.loads(shard.with_name(shard.name.removesuffix(".gz") + ".meta.json").read_text())
        assert stats.read == len(conversations) == meta["conversations"] and not stats.skipped, shard.name
        assert all(sum(t["role"] == "user" for t in c.turns) <= 2 for c in conversations), shard.name
        assert all(c.turns[-1]["role"] == "assistant" for c in conversations), shard.name
        assert meta["target"]["revision"] == "gguf-sha256-" + sha256_file(smollm2_gguf_path())
        assert meta["settings"]["max_turns"] == 2 and meta["sample"]["shard"] == int(shard.name.split("-")[1])
        assert "draftsmith data regenerate sharegpt" in meta["command"], shard.name
        seen += [c.id for c in conversations]
    assert len(seen) == len(set(seen)) == 17306
    stats = ReadStats()
    assert sum(1 for _ in read_conversations(str(folder), stats)) == stats.read == 17306  # the folder as one set


def test_bundled_default_dataset_is_complete_and_usable():
    path = default_dataset_path()
    assert path.is_file(), "the default dataset must ship inside the package"
    stats = ReadStats()
    conversations = list(read_conversations(str(path), stats))
    assert stats.read == len(conversations) >= 250 and not stats.skipped
    categories = {c.id.rsplit("-", 1)[0] for c in conversations}
    assert categories == {"chat", "writing", "coding", "math", "summarisation", "extraction"}
    assert sum(len(c.turns) > 2 for c in conversations) >= 20  # multi-turn conversations are in it
    meta = json.loads(path.with_name(path.name + ".meta.json").read_text())
    assert meta["target"]["name"].startswith("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_the_commands_printed_after_an_export_name_a_target_other_than_the_default():
    from draftsmith.core.target import EMBEDDED_TARGETS
    from draftsmith.train.commands import _target_option

    def identity(name):
        return {"target_identity": {"name": name}}

    assert _target_option(identity(EMBEDDED_TARGETS["smollm2"].display_name)) == ""
    assert _target_option(identity(EMBEDDED_TARGETS["gemma3"].display_name)) == " --target gemma3"
    assert _target_option(identity("my-org/my-model")) == " --target my-org/my-model"
    assert _target_option({}) == ""
